// The owner update's host side: its inputs checked (they decide the rows the
// update writes and the gradient it reads), the kernels' parameters built, the
// GPU op's launch (its kernels: owner_update.cu), and the CPU path: the walk of
// owner_update.h with one CPU thread per chunk of sorted ids.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "op_config.h"
#include "owner_update.h"

namespace torchrec_pgas {
namespace {

void check_ids(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n, const at::Device& device) {
  PGAS_CHECK(t.scalar_type() == dtype && t.dim() == 1 && t.is_contiguous(),
             "owner_update: %s must be a contiguous 1-D %s tensor", name, c10::toString(dtype));
  PGAS_CHECK(t.numel() == n, "owner_update: %s has %lld elements, expected %lld", name,
             static_cast<long long>(t.numel()), static_cast<long long>(n));
  PGAS_CHECK(t.device() == device, "owner_update: %s is on another device than the gradient", name);
}

// An optional int64 word the kernels read on the device (a captured step's `apply` or `used`).
void check_device_word(const c10::optional<at::Tensor>& word, const char* name, const at::Device& device) {
  PGAS_CHECK(!word.has_value() || (word->scalar_type() == at::kLong && word->numel() == 1 && word->device() == device),
             "owner_update: %s must be one int64 word on the gradient's device", name);
}

OwnerUpdateConfig checked_config(const at::Tensor& config) {
  const OwnerUpdateConfig c = config_from_bytes<OwnerUpdateConfig>(config, "owner_update", "an OwnerUpdateConfig");
  const auto opt = static_cast<int64_t>(c.optimizer), wd = static_cast<int64_t>(c.weight_decay_mode);
  PGAS_CHECK(opt >= 0 && opt <= static_cast<int64_t>(Optimizer::kAdam), "owner_update: optimizer %lld unknown",
             static_cast<long long>(opt));
  PGAS_CHECK(wd >= 0 && wd <= static_cast<int64_t>(WeightDecay::kDecouple),
             "owner_update: weight_decay_mode %lld unknown", static_cast<long long>(wd));
  PGAS_CHECK(c.batch > 0, "owner_update: batch %lld must be positive", static_cast<long long>(c.batch));
  return c;
}

// A state tensor of table t: fp32, contiguous, on the weights' device, `numel` elements.
float* checked_state(at::TensorList states, size_t t, const char* name, int64_t numel, const at::Tensor& weights) {
  PGAS_CHECK(states.size() > t, "owner_update: %s has %zu tensors; table %zu needs one", name, states.size(), t);
  const at::Tensor& s = states[t];
  PGAS_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == numel &&
                 s.device() == weights.device(),
             "owner_update: %s[%zu] must be a contiguous fp32 tensor of %lld elements beside the weights", name, t,
             static_cast<long long>(numel));
  return s.data_ptr<float>();
}

// The tables' views, checked against what the optimizer updates; key bases are the running sum of the rows.
std::vector<OwnerTable> checked_tables(at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                                       const OwnerUpdateConfig& c, const at::Device& device) {
  std::vector<OwnerTable> tables;
  int64_t key_base = 0;
  for (size_t t = 0; t < weights.size(); ++t) {
    const at::Tensor& w = weights[t];
    PGAS_CHECK(w.dim() == 2 && w.is_contiguous() && w.device() == device && w.scalar_type() == weights[0].scalar_type(),
               "owner_update: weights[%zu] must be a contiguous [rows, dim] tensor on the gradient's device, of "
               "the first table's dtype", t);
    PGAS_CHECK(w.size(1) > 0 && w.size(1) <= kOwnerMaxDim, "owner_update: table %zu has dim %lld, outside [1, %d]",
               t, static_cast<long long>(w.size(1)), kOwnerMaxDim);
    PGAS_CHECK(w.size(0) < (int64_t{1} << 31), "owner_update: table %zu has %lld rows, more than int32 row numbers",
               t, static_cast<long long>(w.size(0)));
    OwnerTable table{w.data_ptr(), nullptr, nullptr, key_base, w.size(0), w.size(1)};
    if (c.optimizer == Optimizer::kRowwiseAdagrad) {
      table.momentum1 = checked_state(momentum1, t, "momentum1", w.size(0), w);
    } else if (c.optimizer == Optimizer::kAdam) {
      table.momentum1 = checked_state(momentum1, t, "momentum1", w.numel(), w);
      table.momentum2 = checked_state(momentum2, t, "momentum2", w.numel(), w);
    }
    tables.push_back(table);
    key_base += w.size(0);
  }
  return tables;
}

void check_features(const at::Tensor& features, const std::vector<OwnerTable>& tables, int64_t grad_cols) {
  constexpr int64_t kWords = sizeof(OwnerFeatureDesc) / 8;
  PGAS_CHECK(features.device().is_cpu() && features.scalar_type() == at::kLong && features.dim() == 2 &&
                 features.size(1) == kWords && features.is_contiguous(),
             "owner_update: features must be CPU int64 [F, %lld] (OwnerFeatureDesc words)",
             static_cast<long long>(kWords));
  const auto* f = reinterpret_cast<const OwnerFeatureDesc*>(features.data_ptr<int64_t>());
  const auto num_tables = static_cast<int64_t>(tables.size());
  for (int64_t i = 0; i < features.size(0); ++i) {
    PGAS_CHECK(f[i].table >= 0 && f[i].table < num_tables, "owner_update: feature %lld names table %lld of %lld",
               static_cast<long long>(i), static_cast<long long>(f[i].table), static_cast<long long>(num_tables));
    PGAS_CHECK(f[i].grad_col >= 0 && f[i].grad_col + tables[f[i].table].dim <= grad_cols,
               "owner_update: feature %lld's columns [%lld, +%lld) exceed the gradient's %lld",
               static_cast<long long>(i), static_cast<long long>(f[i].grad_col),
               static_cast<long long>(tables[f[i].table].dim), static_cast<long long>(grad_cols));
  }
}

// A descriptor table on `device`, one copy per distinct content, kept for the process: a TBE's tables and
// features upload once (another copy when its storage moves, a few per model), later updates copy nothing,
// and a CUDA graph that captured an update reads the same copy at every replay. Never built under capture.
at::Tensor device_copy(const at::Tensor& host, const at::Device& device) {
  if (device.is_cpu()) return host;
  const at::Tensor bytes = host.contiguous();
  std::string key(static_cast<const char*>(bytes.data_ptr()), bytes.nbytes());
  key += "@" + std::to_string(device.index());
  static std::mutex mutex;
  static std::unordered_map<std::string, at::Tensor> copies;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = copies.find(key);
  if (it != copies.end()) return it->second;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()), &capture));
  PGAS_CHECK(capture == cudaStreamCaptureStatusNone,
             "owner_update: a TBE's first update (or its first since its storage moved) cannot be captured in a "
             "CUDA graph: its descriptors are uploaded then; run one step eagerly before capturing");
  // pinned and non-blocking: a copy from pageable memory syncs the stream (the caching host allocator keeps
  // the pinned block until the copy has run)
  at::Tensor copy = bytes.pin_memory().to(device, /*non_blocking=*/true);
  copies.emplace(std::move(key), copy);
  return copy;
}

struct HostLanes {
  static constexpr int kCount = 1;
  static constexpr int kMaxColumns = kOwnerMaxDim;
  static constexpr int kDepth = 1;
  int lane = 0;
  int columns(int dim) const { return dim; }
  float sum(float x) const { return x; }
  unsigned ballot(bool flag) const { return flag ? 1u : 0u; }
  int first(unsigned) const { return 0; }
  IdMeta* slot;  // the walker's one staged position
  void stage(const IdMeta& m) const { *slot = m; }
  IdMeta staged(int) const { return *slot; }
  void sync() const {}
};

// Both phases with a CPU thread per chunk (one walker's chunk sizes: 256 positions from 256 ids on), the
// partials in a buffer of their own.
template <typename weight_t, typename grad_t, Optimizer kOptimizer>
void update_on_host(OwnerUpdateParams p, int64_t max_dim) {
  const int64_t used = used_positions(p), size = chunk_positions(used, p.walkers);
  const int64_t chunks = (used + size - 1) / size;
  p.partial_stride = 2 * max_dim + 1;
  std::vector<float> partials(static_cast<size_t>(2 * chunks * p.partial_stride));
  p.partials = partials.data();
  using Lanes = HostLanes;
  at::parallel_for(0, chunks, 8, [&](int64_t lo, int64_t hi) {
    IdMeta staged;
    for (int64_t c = lo; c < hi; ++c) {
      walk_chunk<Lanes, weight_t, grad_t, kOptimizer>(p, c, size, used, Lanes{0, &staged});
    }
  });
  at::parallel_for(0, chunks, 8, [&](int64_t lo, int64_t hi) {
    IdMeta staged;
    for (int64_t c = lo; c < hi; ++c) {
      finish_run<Lanes, weight_t, kOptimizer>(p, c, size, used, Lanes{0, &staged});
    }
  });
}

// The op's inputs checked, naming the bad one, and the kernels' parameters built from them, their tables and
// feature descriptors' device copies in `on_device` (kept for the process, one per distinct content). The
// gradient's dtype is checked by the dispatch.
OwnerUpdateParams owner_update_params(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& offsets,
                                      const c10::optional<at::Tensor>& psw, const at::Tensor& grad,
                                      at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                                      const at::Tensor& features, const at::Tensor& hyper, const at::Tensor& config,
                                      const c10::optional<at::Tensor>& apply, const c10::optional<at::Tensor>& used,
                                      std::vector<at::Tensor>& on_device) {
  const OwnerUpdateConfig c = checked_config(config);
  const int64_t n = keys.numel(), num_features = features.dim() == 2 ? features.size(0) : 0;
  const at::Device device = grad.device();
  PGAS_CHECK(grad.dim() == 2 && grad.stride(1) == 1 && grad.size(0) >= c.batch,
             "owner_update: grad must be [>= batch, D] with unit column stride");
  PGAS_CHECK(num_features * c.batch < (int64_t{1} << 31), "owner_update: %lld bags exceed int32 bag numbers",
             static_cast<long long>(num_features * c.batch));
  check_ids(keys, "keys", keys.scalar_type() == at::kInt ? at::kInt : at::kLong, n, device);
  check_ids(bags, "bags", at::kInt, n, device);
  check_ids(offsets, "offsets", at::kLong, num_features * c.batch + 1, device);
  PGAS_CHECK(!c.weighted || (psw.has_value() && psw->scalar_type() == at::kFloat && psw->is_contiguous() &&
                             psw->numel() == n && psw->device() == device),
             "owner_update: a weighted update needs contiguous fp32 per-sample weights, one per id");
  PGAS_CHECK(hyper.scalar_type() == at::kFloat && hyper.numel() == sizeof(OwnerHyper) / 4 && hyper.is_contiguous() &&
                 hyper.device() == device,
             "owner_update: hyper must be the %zu fp32 words of an OwnerHyper on the gradient's device",
             sizeof(OwnerHyper) / 4);
  check_device_word(apply, "apply", device);
  check_device_word(used, "used", device);
  PGAS_CHECK(!weights.empty(), "owner_update: no table");
  const std::vector<OwnerTable> tables = checked_tables(weights, momentum1, momentum2, c, device);
  check_features(features, tables, grad.size(1));
  const auto table_bytes = static_cast<int64_t>(tables.size() * sizeof(OwnerTable));
  at::Tensor tables_host = at::empty({table_bytes}, at::kByte);
  std::memcpy(tables_host.data_ptr(), tables.data(), table_bytes);
  on_device = {device_copy(features, device), device_copy(tables_host, device)};
  return OwnerUpdateParams{
      keys.scalar_type() == at::kInt ? keys.data_ptr<int32_t>() : nullptr,
      keys.scalar_type() == at::kInt ? nullptr : keys.data_ptr<int64_t>(),
      bags.data_ptr<int32_t>(),
      offsets.data_ptr<int64_t>(),
      c.weighted ? psw->data_ptr<float>() : nullptr,
      grad.data_ptr(),
      grad.stride(0),
      reinterpret_cast<const OwnerFeatureDesc*>(on_device[0].data_ptr<int64_t>()),
      reinterpret_cast<const OwnerTable*>(on_device[1].data_ptr()),
      reinterpret_cast<const OwnerHyper*>(hyper.data_ptr<float>()),
      c,
      n,
      num_features,
      static_cast<int64_t>(tables.size()),
      apply.has_value() ? apply->data_ptr<int64_t>() : nullptr,
      used.has_value() ? used->data_ptr<int64_t>() : nullptr,
      1,  // walkers: the launch sets its own
      nullptr,  // partials: the launch allocates them
      0,
  };
}

// The widest table's dim: it sizes the GPU lanes' columns and the partials.
int64_t widest_dim(at::TensorList weights) {
  int64_t widest = 0;
  for (const at::Tensor& w : weights) widest = w.size(1) > widest ? w.size(1) : widest;
  return widest;
}

}  // namespace

void owner_update_cuda(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& offsets,
                       const c10::optional<at::Tensor>& psw, const at::Tensor& grad,
                       at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                       const at::Tensor& features, const at::Tensor& hyper, const at::Tensor& config,
                       const c10::optional<at::Tensor>& apply, const c10::optional<at::Tensor>& used) {
  const c10::cuda::CUDAGuard guard(grad.device());
  std::vector<at::Tensor> on_device;  // the descriptors' device copies
  const OwnerUpdateParams p = owner_update_params(keys, bags, offsets, psw, grad, weights, momentum1, momentum2,
                                                  features, hyper, config, apply, used, on_device);
  at::Tensor partials;  // the launch's own allocation, freed in stream order
  launch_owner_update(
      p, grad.scalar_type(), weights[0].scalar_type(), widest_dim(weights),
      [&](int64_t count) {
        partials = at::empty({count}, grad.options().dtype(at::kFloat));
        return partials.data_ptr<float>();
      },
      c10::cuda::getCurrentCUDAStream());
}

// CPU implementation of torchrec_pgas::owner_update (the same algorithm as the CUDA kernel).
void owner_update_cpu(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& offsets,
                      const c10::optional<at::Tensor>& psw, const at::Tensor& grad,
                      at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                      const at::Tensor& features, const at::Tensor& hyper, const at::Tensor& config,
                      const c10::optional<at::Tensor>& apply, const c10::optional<at::Tensor>& used) {
  std::vector<at::Tensor> on_device;
  const OwnerUpdateParams p = owner_update_params(keys, bags, offsets, psw, grad, weights, momentum1, momentum2,
                                                  features, hyper, config, apply, used, on_device);
  if (p.apply != nullptr && *p.apply == 0) return;
  const int64_t max_dim = widest_dim(weights);
  dispatch_owner_update(grad.scalar_type(), weights[0].scalar_type(), p.config.optimizer,
                        [&](auto weight, auto grad_type, auto optimizer) {
                          update_on_host<decltype(weight), decltype(grad_type), decltype(optimizer)::value>(p, max_dim);
                        });
}

}  // namespace torchrec_pgas
