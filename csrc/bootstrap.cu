// NVSHMEM bootstrap and symmetric allocation for torchrec-pgas.
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
#include <nvshmem.h>
#include <nvshmemx.h>

#include "pgas_common.cuh"

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

}  // namespace torchrec_pgas
