// The PGAS runtime's ops on the host (torch.ops.torchrec_pgas.pgas_*): NVSHMEM bootstrap, symmetric
// allocation, and the reference put / signal / wait, whose kernels are put_signal.cu. Host code only: compiled
// without nvcc, calling NVSHMEM's host API.
//
// The process may already hold an NVSHMEM world started by PyTorch's symmetric
// memory (same libnvshmem_host.so.3). nvshmemx_init_attr is always called from
// this library anyway: it is header-inline code that registers *this* .so's
// statically linked device state with the host library (refcounted; bootstrap
// arguments are ignored when the host side is already up).
#include <cstring>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAStream.h>
#include <nvshmem_host.h>  // NVSHMEM's host API alone: no device headers in a host compiler's file

#include "pgas_check.h"
#include "put_signal.h"

namespace torchrec_pgas {

at::Tensor pgas_unique_id() {
  nvshmemx_uniqueid_t uid;
  PGAS_CHECK(nvshmemx_get_uniqueid(&uid) == 0, "nvshmemx_get_uniqueid failed");
  auto out = at::empty({static_cast<int64_t>(sizeof(uid))}, at::kByte);
  std::memcpy(out.data_ptr(), &uid, sizeof(uid));
  return out;
}

void pgas_init(const at::Tensor& uid, int64_t rank, int64_t world_size) {
  PGAS_CHECK(uid.device().is_cpu() && uid.scalar_type() == at::kByte &&
                 uid.numel() == static_cast<int64_t>(sizeof(nvshmemx_uniqueid_t)),
             "pgas_init: uid must be the CPU uint8 tensor of pgas_unique_id()");
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.contiguous().data_ptr(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  PGAS_CHECK(nvshmemx_set_attr_uniqueid_args(static_cast<int>(rank), static_cast<int>(world_size), &id,
                                             &attr) == 0,
             "nvshmemx_set_attr_uniqueid_args failed");
  PGAS_CHECK(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) == 0,
             "nvshmemx_init_attr failed (is NVSHMEM_SYMMETRIC_SIZE larger than free GPU memory?)");
  PGAS_CHECK(nvshmem_my_pe() == rank && nvshmem_n_pes() == world_size,
             "NVSHMEM world (pe %d of %d) differs from the process group (rank %lld of %lld): torchrec-pgas "
             "needs the global world, as torch's symmetric memory uses",
             nvshmem_my_pe(), nvshmem_n_pes(), static_cast<long long>(rank), static_cast<long long>(world_size));
}

void pgas_finalize() { nvshmem_finalize(); }

// Collective: `nbytes` of zeroed symmetric memory. Not freed by the tensor's
// deleter (nvshmem_free is collective too); call nvshmem_free explicitly.
at::Tensor pgas_alloc(int64_t nbytes) {
  PGAS_CHECK(nbytes > 0, "pgas_alloc: nbytes must be > 0, got %lld", static_cast<long long>(nbytes));
  void* ptr = nvshmem_align(256, static_cast<size_t>(nbytes));
  PGAS_CHECK(ptr != nullptr, "nvshmem_align(%lld) failed: raise NVSHMEM_SYMMETRIC_SIZE before the first PGAS sharding",
             static_cast<long long>(nbytes));
  auto stream = c10::cuda::getCurrentCUDAStream();
  PGAS_CUDA_CHECK(cudaMemsetAsync(ptr, 0, static_cast<size_t>(nbytes), stream));
  nvshmemx_barrier_all_on_stream(stream);  // peers must see zeroed pads before any put
  auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, at::cuda::current_device());
  return at::from_blob(ptr, {nbytes}, [](void*) {}, opts);
}

// Address of `local`'s counterpart on `pe` for plain loads/stores (NVLink
// peer mapping), or 0 when that PE is reachable only through puts.
int64_t pgas_peer_ptr(const at::Tensor& local, int64_t pe) {
  return reinterpret_cast<int64_t>(nvshmem_ptr(local.data_ptr(), static_cast<int>(pe)));
}

void pgas_free(const at::Tensor& buf) { nvshmem_free(buf.data_ptr()); }

void pgas_barrier_all() { nvshmemx_barrier_all_on_stream(c10::cuda::getCurrentCUDAStream()); }

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
  launch_put(static_cast<uint8_t*>(dst.data_ptr()), static_cast<const uint8_t*>(src.data_ptr()), nbytes,
             static_cast<int>(peer), c10::cuda::getCurrentCUDAStream());
}

void pgas_signal(const at::Tensor& word, int64_t value, int64_t peer) {
  PGAS_CHECK(word.is_cuda() && word.scalar_type() == at::kLong && word.numel() == 1,
             "pgas_signal: one int64 CUDA word expected");
  PGAS_CHECK(peer >= 0 && peer < nvshmem_n_pes(), "pgas_signal: peer %lld outside world", static_cast<long long>(peer));
  launch_signal(reinterpret_cast<uint64_t*>(word.data_ptr()), static_cast<uint64_t>(value), static_cast<int>(peer),
                c10::cuda::getCurrentCUDAStream());
}

void pgas_wait(const at::Tensor& pad, const at::Tensor& slots, int64_t epoch, int64_t timeout_ns,
               const at::Tensor& status) {
  PGAS_CHECK(pad.is_cuda() && pad.scalar_type() == at::kLong, "pgas_wait: int64 CUDA pad expected");
  PGAS_CHECK(slots.is_cuda() && slots.scalar_type() == at::kLong && slots.numel() <= 1024,
             "pgas_wait: at most 1024 int64 CUDA slot indices expected");
  PGAS_CHECK(status.is_pinned() && status.scalar_type() == at::kLong && status.numel() >= 2,
             "pgas_wait: status must be a pinned int64 host tensor of 2 words");
  if (slots.numel() == 0) return;
  launch_wait(pad.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), static_cast<int>(slots.numel()), epoch, timeout_ns,
              status.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
}

}  // namespace torchrec_pgas
