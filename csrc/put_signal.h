// The launches of the runtime's reference put / signal / wait kernels (put_signal.cu), on `stream`, their
// arguments checked by the ops that call them (runtime.cpp). A launch error raises.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace torchrec_pgas {

void launch_put(uint8_t* dst, const uint8_t* src, size_t nbytes, int peer, cudaStream_t stream);
void launch_signal(uint64_t* word, uint64_t value, int peer, cudaStream_t stream);
// One thread a slot (at most 1024): each waits until pad[slots[i]] >= epoch.
void launch_wait(const int64_t* pad, const int64_t* slots, int num_slots, int64_t epoch, int64_t timeout_ns,
                 int64_t* status, cudaStream_t stream);

}  // namespace torchrec_pgas
