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
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAStream.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "pgas_common.cuh"
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

void pgas_put(const at::Tensor& dst, const at::Tensor& src, int64_t peer) {
  PGAS_CHECK(dst.is_cuda() && src.is_cuda() && dst.is_contiguous() && src.is_contiguous(),
             "pgas_put: contiguous CUDA tensors expected");
  const size_t nbytes = src.numel() * src.element_size();
  PGAS_CHECK(static_cast<size_t>(dst.numel() * dst.element_size()) >= nbytes,
             "pgas_put: destination of %lld bytes is smaller than the source of %zu",
             static_cast<long long>(dst.numel() * dst.element_size()), nbytes);
  PGAS_CHECK(peer >= 0 && peer < nvshmem_n_pes(), "pgas_put: peer %lld outside world", static_cast<long long>(peer));
  PGAS_CHECK(nvshmem_ptr(dst.data_ptr(), nvshmem_my_pe()) != nullptr, "pgas_put: destination is not symmetric memory");
  if (nbytes == 0) return;
  const unsigned blocks = static_cast<unsigned>((nbytes + kPutChunk - 1) / kPutChunk);
  put_kernel<<<blocks, kPutThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<uint8_t*>(dst.data_ptr()), static_cast<const uint8_t*>(src.data_ptr()), nbytes,
      static_cast<int>(peer));
  PGAS_CUDA_CHECK(cudaGetLastError());
}

void pgas_signal(const at::Tensor& word, int64_t value, int64_t peer) {
  PGAS_CHECK(word.is_cuda() && word.scalar_type() == at::kLong && word.numel() == 1,
             "pgas_signal: one int64 CUDA word expected");
  PGAS_CHECK(peer >= 0 && peer < nvshmem_n_pes(), "pgas_signal: peer %lld outside world", static_cast<long long>(peer));
  signal_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<uint64_t*>(word.data_ptr()), static_cast<uint64_t>(value),
      static_cast<int>(peer));
  PGAS_CUDA_CHECK(cudaGetLastError());
}

void pgas_wait(const at::Tensor& pad, const at::Tensor& slots, int64_t epoch, int64_t timeout_ns,
               const at::Tensor& status) {
  PGAS_CHECK(pad.is_cuda() && pad.scalar_type() == at::kLong, "pgas_wait: int64 CUDA pad expected");
  PGAS_CHECK(slots.is_cuda() && slots.scalar_type() == at::kLong && slots.numel() <= 1024,
             "pgas_wait: at most 1024 int64 CUDA slot indices expected");
  PGAS_CHECK(status.is_pinned() && status.scalar_type() == at::kLong && status.numel() >= 2,
             "pgas_wait: status must be a pinned int64 host tensor of 2 words");
  if (slots.numel() == 0) return;
  wait_kernel<<<1, static_cast<unsigned>(slots.numel()), 0, c10::cuda::getCurrentCUDAStream()>>>(
      pad.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), static_cast<int>(slots.numel()), epoch,
      timeout_ns, status.data_ptr<int64_t>());
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
