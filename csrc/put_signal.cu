// The reference path of the PGAS runtime on GPUs: put, signal, wait
// (torch.ops.torchrec_pgas), behind PgasRuntime.put/signal/wait of the nvshmem
// backend. The fused stage kernels do not use them (they store into peers
// through NVLink pointers inside one launch); the runtime's abort is built on
// put + signal, and the tests check the runtime API here. They are the path
// for peers that are not load/store reachable.
//
// Memory layout: every buffer is symmetric (nvshmem_align), so a *local*
// address names the same offset on every PE. A signal pad is an int64 array
// (step_abi.h PadWord):
//   [0]        abort word: (epoch << kAbortRankBits) | (aborting rank + 1), 0 while healthy
//   [1..31]    abort reason (UTF-8)
//   [32..]     epoch slots
//
// Protocol: put(dst, src, peer) moves the bytes and completes them
// (nvshmem_quiet) before the kernel ends; signal(word, epoch, peer) then
// stores the epoch into the peer's word. Both run on the current stream, so
// a signal never overtakes the puts issued before it. wait() spins on the
// local slots until each is >= epoch (acquire loads), gives up when a peer
// aborted this epoch (the abort word's epoch) or after a timeout, and reports either into a pinned status word
// that the host reads after synchronizing.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "pgas_common.cuh"
#include "put_signal.h"
#include "step_abi.h"

namespace torchrec_pgas {
namespace {

constexpr int kPutThreads = 512;
constexpr size_t kPutChunk = size_t(1) << 20;  // bytes per block

__global__ void put_kernel(uint8_t* dst, const uint8_t* src, size_t nbytes, int peer) {
  const size_t begin = static_cast<size_t>(blockIdx.x) * kPutChunk;
  const size_t len = min(kPutChunk, nbytes - begin);
  nvshmemx_putmem_nbi_block(dst + begin, src + begin, len, peer);
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_quiet();
}

__global__ void signal_kernel(uint64_t* word, uint64_t value, int peer) {
  nvshmemx_signal_op(word, value, NVSHMEM_SIGNAL_SET, peer);
}

// One thread per waited slot.
__global__ void wait_kernel(const int64_t* pad, const int64_t* slots, int num_slots, int64_t epoch,
                            int64_t timeout_ns, int64_t* status) {
  const int i = threadIdx.x;
  if (i >= num_slots) return;
  const int64_t* word = pad + slots[i];
  const uint64_t start = global_timer_ns();
  bool arrived = false;
  do {
    // The slot first (acquire), then the abort word: a peer that gave this step up aborted before it
    // signalled a later one, so a signal seen here cannot hide that abort.
    arrived = ld_acquire_sys(word) >= epoch;
    if (ld_volatile(pad) >> kAbortRankBits == epoch) {  // a peer gave up on this step
      status[0] = static_cast<int64_t>(DeviceStatus::kPeerAbort);
      return;
    }
    if (!arrived && global_timer_ns() - start > static_cast<uint64_t>(timeout_ns)) {
      status[0] = static_cast<int64_t>(DeviceStatus::kTimeout);
      status[1] = slots[i];
      return;
    }
  } while (!arrived);
}

}  // namespace

void launch_put(uint8_t* dst, const uint8_t* src, size_t nbytes, int peer, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((nbytes + kPutChunk - 1) / kPutChunk);
  put_kernel<<<blocks, kPutThreads, 0, stream>>>(dst, src, nbytes, peer);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

void launch_signal(uint64_t* word, uint64_t value, int peer, cudaStream_t stream) {
  signal_kernel<<<1, 1, 0, stream>>>(word, value, peer);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

void launch_wait(const int64_t* pad, const int64_t* slots, int num_slots, int64_t epoch, int64_t timeout_ns,
                 int64_t* status, cudaStream_t stream) {
  wait_kernel<<<1, static_cast<unsigned>(num_slots), 0, stream>>>(pad, slots, num_slots, epoch, timeout_ns, status);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
