// Operator registration of torchrec-pgas (torch.ops.torchrec_pgas.*), FBGEMM style:
// schemas here; the implementations' host side (tensor checks, then a kernel
// file's launch) in step_ops.cpp, runtime.cpp and *_host.cpp, with the CPU
// paths; meta implementations for the ops that return tensors so that
// fake-tensor tracing sees their shapes.
#include <Python.h>  // first, as Python asks: the module's init below

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "step_abi.h"

namespace torchrec_pgas {

at::Tensor pgas_unique_id();
void pgas_init(const at::Tensor& uid, int64_t rank, int64_t world_size);
void pgas_finalize();
at::Tensor pgas_alloc(int64_t nbytes);
void pgas_free(const at::Tensor& buf);
int64_t pgas_peer_ptr(const at::Tensor& local, int64_t pe);
void pgas_barrier_all();
void pgas_put(const at::Tensor& dst, const at::Tensor& src, int64_t peer);
void pgas_signal(const at::Tensor& word, int64_t value, int64_t peer);
void pgas_wait(const at::Tensor& pad, const at::Tensor& slots, int64_t epoch, int64_t timeout_ns,
               const at::Tensor& status);

void index_dist(const at::Tensor& values, const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                const at::Tensor& config, int64_t batch, bool give_up, bool abort_on_failure);
void pooled_lookup(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                   const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                   const at::Tensor& config, int64_t batch, int64_t max_dim, at::ScalarType out_dtype,
                   bool after_exit, bool release);
at::Tensor combine_partials(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                            const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
                            const at::Tensor& status, const at::Tensor& config, const at::Tensor& col_feature,
                            int64_t batch, at::ScalarType out_dtype);
void grad_dist(const at::Tensor& grad, const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
               const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
               const at::Tensor& status, const at::Tensor& config, int64_t epoch, int64_t batch, double divisor,
               bool abort);
void await_grads(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                 const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                 const at::Tensor& config, const at::Tensor& flags, int64_t epoch);
void release_sources(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                     const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
                     const at::Tensor& status, const at::Tensor& config, int64_t epoch);
void owner_update_cpu(const at::Tensor& keys, const at::Tensor& bags,
                      const at::Tensor& offsets, const c10::optional<at::Tensor>& psw, const at::Tensor& grad,
                      at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                      const at::Tensor& features, const at::Tensor& hyper, const at::Tensor& config,
                      const c10::optional<at::Tensor>& apply, const c10::optional<at::Tensor>& used);
void owner_update_cuda(const at::Tensor& keys, const at::Tensor& bags,
                       const at::Tensor& offsets, const c10::optional<at::Tensor>& psw, const at::Tensor& grad,
                       at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                       const at::Tensor& features, const at::Tensor& hyper, const at::Tensor& config,
                       const c10::optional<at::Tensor>& apply, const c10::optional<at::Tensor>& used);
using OwnerKeys = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using KeptBags = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
OwnerKeys owner_keys_cpu(const at::Tensor& ids, const c10::optional<at::Tensor>& weights, const at::Tensor& first_id,
                         const c10::optional<at::Tensor>& first_weight, const at::Tensor& offsets,
                         const at::Tensor& feature_base, const at::Tensor& config, int64_t capacity);
OwnerKeys owner_keys_cuda(const at::Tensor& ids, const c10::optional<at::Tensor>& weights, const at::Tensor& first_id,
                          const c10::optional<at::Tensor>& first_weight, const at::Tensor& offsets,
                          const at::Tensor& feature_base, const at::Tensor& config, int64_t capacity);
KeptBags kept_bags_cpu(const at::Tensor& buffer, const at::Tensor& slot_base, const at::Tensor& batches,
                       const c10::optional<at::Tensor>& whole, const at::Tensor& config, int64_t num_bags,
                       bool weighted);
KeptBags kept_bags_cuda(const at::Tensor& buffer, const at::Tensor& slot_base, const at::Tensor& batches,
                        const c10::optional<at::Tensor>& whole, const at::Tensor& config, int64_t num_bags,
                        bool weighted);
OwnerKeys sort_owner_keys_cpu(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw, int64_t key_limit,
                              const c10::optional<at::Tensor>& count);
OwnerKeys sort_owner_keys_cuda(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw,
                               int64_t key_limit, const c10::optional<at::Tensor>& count);
OwnerKeys sort_owner_keys_meta(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw,
                               int64_t key_limit, const c10::optional<at::Tensor>& count);
at::Tensor combine_partials_meta(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                                 const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
                                 const at::Tensor& status, const at::Tensor& config, const at::Tensor& col_feature,
                                 int64_t batch, at::ScalarType out_dtype);

namespace {
at::Tensor step_abi_description() {
  const size_t len = describe_step_abi(nullptr, 0);
  auto out = at::empty({static_cast<int64_t>(len + 1)}, at::kByte);
  describe_step_abi(static_cast<char*>(out.data_ptr()), len + 1);
  return out.narrow(0, 0, static_cast<int64_t>(len));  // without the NUL
}

at::Tensor alloc_meta(int64_t nbytes) {
  return at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta));
}
}  // namespace

}  // namespace torchrec_pgas

TORCH_LIBRARY(torchrec_pgas, m) {
  // The Python <-> CUDA contract this build was compiled with (step_abi.h), as text bytes (CPU uint8).
  m.def("step_abi() -> Tensor", &torchrec_pgas::step_abi_description);
  // Bootstrap and allocation: host-side, no tensor dispatch key.
  m.def("unique_id() -> Tensor", &torchrec_pgas::pgas_unique_id);
  m.def("init(Tensor uid, int rank, int world_size) -> ()", &torchrec_pgas::pgas_init);
  m.def("finalize() -> ()", &torchrec_pgas::pgas_finalize);
  m.def("barrier_all() -> ()", &torchrec_pgas::pgas_barrier_all);
  m.def("alloc(int nbytes) -> Tensor");
  m.def("free(Tensor buf) -> ()");
  m.def("peer_ptr(Tensor local, int pe) -> int");
  // The runtime's reference put/signal/wait on the current stream (put_signal.cu).
  m.def("put(Tensor(a!) dst, Tensor src, int peer) -> ()");
  m.def("signal(Tensor(a!) word, int value, int peer) -> ()");
  m.def("wait(Tensor pad, Tensor slots, int epoch, int timeout_ns, Tensor(a!) status) -> ()");
  // The three stages of a pgas_row_wise / pgas_table_wise step (step_protocol.cuh), and its
  // backward's gradient exchange (grad_exchange.cu).
  // buf/pad: this rank's symmetric buffer and signal pad; peers: int64[2, W] peer
  // addresses; features: FeatureDesc[F] (int64 words); state: StateWord[kStateWords];
  // bag_div: MEAN divisors; status: pinned ErrorRecord per slot; config: the bytes of a
  // StepConfig (CPU uint8).
  m.def(
      "index_dist(Tensor values, Tensor offsets, Tensor? weights, Tensor(a!) buf, Tensor(b!) pad, Tensor peers, "
      "Tensor features, Tensor(c!) state, Tensor(d!) bag_div, Tensor(e!) status, Tensor config, int batch, "
      "bool give_up, bool abort_on_failure) -> ()");
  m.def(
      "pooled_lookup(Tensor(a!) buf, Tensor(b!) pad, Tensor peers, Tensor features, Tensor(c!) state, "
      "Tensor bag_div, Tensor(d!) status, Tensor config, int batch, int max_dim, ScalarType out_dtype, "
      "bool after_exit, bool release) -> ()");
  m.def(
      "combine_partials(Tensor buf, Tensor(a!) pad, Tensor peers, Tensor features, Tensor(b!) state, "
      "Tensor bag_div, Tensor(c!) status, Tensor config, Tensor col_feature, int batch, ScalarType out_dtype) "
      "-> Tensor");
  m.def(
      "grad_dist(Tensor grad, Tensor buf, Tensor(a!) pad, Tensor peers, Tensor features, Tensor(b!) state, "
      "Tensor bag_div, Tensor status, Tensor config, int epoch, int batch, float divisor, bool abort) -> ()");
  m.def(
      "await_grads(Tensor buf, Tensor pad, Tensor peers, Tensor features, Tensor state, Tensor bag_div, "
      "Tensor status, Tensor config, Tensor(a!) flags, int epoch) -> ()");
  m.def(
      "release_sources(Tensor buf, Tensor(a!) pad, Tensor peers, Tensor features, Tensor state, Tensor bag_div, "
      "Tensor status, Tensor config, int epoch) -> ()");
  // The owner backward's update (owner_update.h): one optimizer step of the rows the kept ids touch, in place
  // in the tables' weights and optimizer states (per table: [rows, dim] weights; momentum1 fp32 [rows]
  // (row-wise Adagrad) or [rows, dim] (Adam); momentum2 [rows, dim] (Adam)). keys: the ids' row keys,
  // sorted (int32 or int64); bags (int32), per_sample_weights: each sorted id's bag and weight; offsets: the
  // kept ids' bag offsets; grad: the pooled gradient; features: CPU OwnerFeatureDesc words; hyper:
  // OwnerHyper (fp32, on the device); config: the bytes of an OwnerUpdateConfig (CPU uint8); apply: none, or
  // an int64 word on the device, 0 for a step no rank may apply (the captured training step's failure check);
  // used: none, or an int64 word on the device, the positions that may hold ids (the rest hold keys past every
  // table: a captured step's fixed capacity), which sizes the walkers' chunks.
  m.def(
      "owner_update(Tensor keys, Tensor bags, Tensor offsets, Tensor? per_sample_weights, "
      "Tensor grad, Tensor(a!)[] weights, Tensor(b!)[] momentum1, Tensor(c!)[] momentum2, Tensor features, "
      "Tensor hyper, Tensor config, Tensor? apply=None, Tensor? used=None) -> ()");
  // The bags an owner kept of a step, read from its buffer (owner_keys.h): buffer, the owner's (uint8);
  // slot_base, one int64 (the slot's first index block, bytes; a device word for a captured step); batches,
  // each source's (int64); whole, one bool or none (false: no bag keeps ids); config: the bytes of a
  // KeptBagsConfig (CPU uint8); num_bags and weighted: the config's bag count and whether it has weights, as
  // the output shapes (what a Meta impl and fake tensors see, who cannot read the config's bytes). Returns
  // (lengths, first_id, first_weight: empty when unweighted), int64.
  m.def("kept_bags(Tensor buffer, Tensor slot_base, Tensor batches, Tensor? whole, Tensor config, int num_bags, "
        "bool weighted) -> (Tensor, Tensor, Tensor)");
  // The owner update's inputs (owner_keys.h): one TBE's kept ids as row keys, bags and per-sample weights at
  // `capacity` positions (a captured step's fixed capacity, or an eager step's id count), padded with
  // key_limit, from the owner's buffer or a KJT's values (ids: as int32 or int64 ids, weights: as fp32) and
  // the bags' device offsets; config: the bytes of an OwnerKeysConfig (CPU uint8). Returns (keys, bags,
  // per_sample_weights: empty when unweighted).
  m.def(
      "owner_keys(Tensor ids, Tensor? weights, Tensor first_id, Tensor? first_weight, Tensor offsets, "
      "Tensor feature_base, Tensor config, int capacity) -> (Tensor, Tensor, Tensor)");
  // The keys sorted, stable, each with its bag and per-sample weight (empty: unweighted); keys outside
  // [0, key_limit] become key_limit. count: one int64 on the keys' device, or none (all keys): only the first
  // count keys (clamped to [0, keys]) are read, sorted and written, with no host read of the count; the
  // outputs' positions past it are left unwritten.
  m.def("sort_owner_keys(Tensor keys, Tensor bags, Tensor per_sample_weights, int key_limit, Tensor? count=None) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torchrec_pgas, CompositeExplicitAutograd, m) {
  m.impl("alloc", &torchrec_pgas::pgas_alloc);
}

// kept_bags and owner_keys take a CPU config beside device tensors: their fakes (and Meta kernels) are Python's,
// torchrec_pgas/op_fakes.py (FakeTensor finds no common device for a C++ Meta kernel's inputs).
TORCH_LIBRARY_IMPL(torchrec_pgas, Meta, m) {
  m.impl("alloc", &torchrec_pgas::alloc_meta);
  m.impl("combine_partials", &torchrec_pgas::combine_partials_meta);
  m.impl("sort_owner_keys", &torchrec_pgas::sort_owner_keys_meta);
}

TORCH_LIBRARY_IMPL(torchrec_pgas, CPU, m) {
  m.impl("owner_update", &torchrec_pgas::owner_update_cpu);
  m.impl("kept_bags", &torchrec_pgas::kept_bags_cpu);
  m.impl("owner_keys", &torchrec_pgas::owner_keys_cpu);
  m.impl("sort_owner_keys", &torchrec_pgas::sort_owner_keys_cpu);
}

TORCH_LIBRARY_IMPL(torchrec_pgas, CUDA, m) {
  m.impl("owner_update", &torchrec_pgas::owner_update_cuda);
  m.impl("kept_bags", &torchrec_pgas::kept_bags_cuda);
  m.impl("owner_keys", &torchrec_pgas::owner_keys_cuda);
  m.impl("sort_owner_keys", &torchrec_pgas::sort_owner_keys_cuda);
  m.impl("free", &torchrec_pgas::pgas_free);
  m.impl("peer_ptr", &torchrec_pgas::pgas_peer_ptr);
  m.impl("put", &torchrec_pgas::pgas_put);
  m.impl("signal", &torchrec_pgas::pgas_signal);
  m.impl("wait", &torchrec_pgas::pgas_wait);
  m.impl("index_dist", &torchrec_pgas::index_dist);
  m.impl("pooled_lookup", &torchrec_pgas::pooled_lookup);
  m.impl("combine_partials", &torchrec_pgas::combine_partials);
  m.impl("grad_dist", &torchrec_pgas::grad_dist);
  m.impl("await_grads", &torchrec_pgas::await_grads);
  m.impl("release_sources", &torchrec_pgas::release_sources);
}

// Importing torchrec_pgas._C registers the ops above; the module itself defines nothing, so it is built with
// Python's C API alone (torch/extension.h would bring pybind11 and all of torch's headers into the build).
static PyModuleDef pgas_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1,
                                  nullptr, nullptr, nullptr, nullptr, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&pgas_module); }
