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
int64_t pgas_peer_ptr(const at::Tensor& local, int64_t pe);
void pgas_barrier_all();
void pgas_put(const at::Tensor& dst, const at::Tensor& src, int64_t peer);
void pgas_signal(const at::Tensor& word, int64_t value, int64_t peer);
void pgas_wait(const at::Tensor& pad, const at::Tensor& slots, int64_t epoch, int64_t timeout_ns,
               const at::Tensor& status);

void rw_index_dist(const at::Tensor& values, const at::Tensor& offsets,
                   const c10::optional<at::Tensor>& weights, const at::Tensor& buf,
                   const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                   const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                   at::IntArrayRef cfg, int64_t batch);
void rw_lookup(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
               const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
               const at::Tensor& status, at::IntArrayRef cfg, int64_t batch, int64_t max_dim,
               at::ScalarType out_dtype, bool after_exit);
at::Tensor rw_finalize(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                       const at::Tensor& features, const at::Tensor& col_feature,
                       const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                       at::IntArrayRef cfg, int64_t batch, at::ScalarType out_dtype);
at::Tensor rw_finalize_meta(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                            const at::Tensor& features, const at::Tensor& col_feature,
                            const at::Tensor& state, const at::Tensor& bag_div,
                            const at::Tensor& status, at::IntArrayRef cfg, int64_t batch,
                            at::ScalarType out_dtype);

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
  m.def("peer_ptr(Tensor local, int pe) -> int");
  // One-sided data movement on the current stream.
  m.def("put(Tensor(a!) dst, Tensor src, int peer) -> ()");
  m.def("signal(Tensor(a!) word, int value, int peer) -> ()");
  m.def("wait(Tensor pad, Tensor slots, int epoch, int timeout_ns, Tensor(a!) status) -> ()");
  // pgas_row_wise and pgas_table_wise, one op per stage (see rw_pipeline.cuh for the protocol).
  // buf/pad: this rank's symmetric buffer and signal pad; peers: int64[2, W]
  // peer addresses; features: int64[F, kFeatureWords] RwFeature rows; state: device
  // scratch; bag_div: MEAN divisors; status: pinned error record; cfg: layout.
  m.def(
      "rw_index_dist(Tensor values, Tensor offsets, Tensor? weights, Tensor(a!) buf, Tensor(b!) pad, "
      "Tensor peers, Tensor features, Tensor(c!) state, Tensor(d!) bag_div, Tensor(e!) status, "
      "int[] cfg, int batch) -> ()");
  m.def(
      "rw_lookup(Tensor(a!) buf, Tensor(b!) pad, Tensor peers, Tensor features, Tensor(c!) state, "
      "Tensor bag_div, Tensor(d!) status, int[] cfg, int batch, int max_dim, ScalarType out_dtype, "
      "bool after_exit) -> ()");
  m.def(
      "rw_finalize(Tensor buf, Tensor(a!) pad, Tensor peers, Tensor features, Tensor col_feature, "
      "Tensor(b!) state, Tensor bag_div, Tensor(c!) status, int[] cfg, int batch, ScalarType out_dtype) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(torchrec_pgas, CompositeExplicitAutograd, m) {
  m.impl("alloc", &torchrec_pgas::pgas_alloc);
}

TORCH_LIBRARY_IMPL(torchrec_pgas, Meta, m) {
  m.impl("alloc", &torchrec_pgas::alloc_meta);
  m.impl("rw_finalize", &torchrec_pgas::rw_finalize_meta);
}

TORCH_LIBRARY_IMPL(torchrec_pgas, CUDA, m) {
  m.impl("free", &torchrec_pgas::pgas_free);
  m.impl("peer_ptr", &torchrec_pgas::pgas_peer_ptr);
  m.impl("put", &torchrec_pgas::pgas_put);
  m.impl("signal", &torchrec_pgas::pgas_signal);
  m.impl("wait", &torchrec_pgas::pgas_wait);
  m.impl("rw_index_dist", &torchrec_pgas::rw_index_dist);
  m.impl("rw_lookup", &torchrec_pgas::rw_lookup);
  m.impl("rw_finalize", &torchrec_pgas::rw_finalize);
}

// Importing torchrec_pgas._C registers the ops above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
