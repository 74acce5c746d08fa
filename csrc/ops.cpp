// Operator registration of torchrec-pgas (torch.ops.torchrec_pgas.*), FBGEMM style:
// schemas here, CUDA implementations in the .cu files, meta implementations for
// the ops that return tensors so that fake-tensor tracing sees their shapes.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/extension.h>

namespace torchrec_pgas {

at::Tensor pgas_unique_id();
int64_t pgas_init_status();
int64_t pgas_init(const at::Tensor& uid, int64_t rank, int64_t world_size);
void pgas_finalize();
at::Tensor pgas_alloc(int64_t nbytes);
void pgas_free(const at::Tensor& buf);
void pgas_barrier_all();
void pgas_put(const at::Tensor& dst, const at::Tensor& src, int64_t peer);
void pgas_signal(const at::Tensor& word, int64_t value, int64_t peer);
void pgas_wait(const at::Tensor& pad, const at::Tensor& slots, int64_t epoch, int64_t timeout_ns,
               const at::Tensor& status);

namespace {
at::Tensor alloc_meta(int64_t nbytes) {
  return at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta));
}
}  // namespace

}  // namespace torchrec_pgas

TORCH_LIBRARY(torchrec_pgas, m) {
  // Bootstrap and allocation: host-side, no tensor dispatch key.
  m.def("unique_id() -> Tensor", &torchrec_pgas::pgas_unique_id);
  m.def("init_status() -> int", &torchrec_pgas::pgas_init_status);
  m.def("init(Tensor uid, int rank, int world_size) -> int", &torchrec_pgas::pgas_init);
  m.def("finalize() -> ()", &torchrec_pgas::pgas_finalize);
  m.def("barrier_all() -> ()", &torchrec_pgas::pgas_barrier_all);
  m.def("alloc(int nbytes) -> Tensor");
  m.def("free(Tensor buf) -> ()");
  // One-sided data movement on the current stream.
  m.def("put(Tensor(a!) dst, Tensor src, int peer) -> ()");
  m.def("signal(Tensor(a!) word, int value, int peer) -> ()");
  m.def("wait(Tensor pad, Tensor slots, int epoch, int timeout_ns, Tensor(a!) status) -> ()");
}

TORCH_LIBRARY_IMPL(torchrec_pgas, CompositeExplicitAutograd, m) {
  m.impl("alloc", &torchrec_pgas::pgas_alloc);
}

TORCH_LIBRARY_IMPL(torchrec_pgas, Meta, m) {
  m.impl("alloc", &torchrec_pgas::alloc_meta);
}

TORCH_LIBRARY_IMPL(torchrec_pgas, CUDA, m) {
  m.impl("free", &torchrec_pgas::pgas_free);
  m.impl("put", &torchrec_pgas::pgas_put);
  m.impl("signal", &torchrec_pgas::pgas_signal);
  m.impl("wait", &torchrec_pgas::pgas_wait);
}

// Importing torchrec_pgas._C registers the ops above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
