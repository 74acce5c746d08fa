// The host side of the step's stage ops (torch.ops.torchrec_pgas.index_dist, pooled_lookup, combine_partials,
// grad_dist, await_grads, release_sources; their schemas: ops.cpp): every tensor checked against the step's
// config and the others before a kernel takes addresses from them (StepParams), then the stage's launch on the
// current stream (step_params.h; the kernels: index_dist.cu, pooled_lookup.cu, combine_partials.cu,
// grad_exchange.cu).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>

#include "op_config.h"
#include "step_params.h"

namespace torchrec_pgas {
namespace {

// The tensors every stage op takes. `nnz`: this rank's ids of the step (index dist), else 0.
StepParams make_step_params(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                            const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
                            const at::Tensor& status, const at::Tensor& config, int64_t batch, int64_t nnz) {
  using ll = long long;
  StepParams p;
  static_cast<StepConfig&>(p) =
      config_from_bytes<StepConfig>(config, "pgas step", "a StepConfig (torchrec_pgas.step_abi)");
  PGAS_CHECK(p.num_slots >= 1 && p.num_slots <= kMaxSlots, "pgas step: %lld buffer slots outside [1, %d]",
             static_cast<ll>(p.num_slots), kMaxSlots);
  PGAS_CHECK(buf.is_cuda() && pad.is_cuda() && peers.is_cuda() && features.is_cuda() && state.is_cuda() &&
                 bag_div.is_cuda() && status.is_pinned() &&
                 status.numel() * status.element_size() == p.num_slots * static_cast<int64_t>(sizeof(ErrorRecord)),
             "pgas step: device state tensors on CUDA, status a pinned ErrorRecord per slot");
  PGAS_CHECK(p.id_bytes == 4 || p.id_bytes == 8, "pgas step: id width %d bytes", p.id_bytes);
  PGAS_CHECK(p.world >= 1 && p.world <= kMaxWorld, "pgas step: world size %d outside [1, %d]", p.world, kMaxWorld);
  PGAS_CHECK(peers.numel() == 2 * p.world &&
                 features.numel() * 8 == p.num_features * static_cast<int64_t>(sizeof(FeatureDesc)) &&
                 state.numel() >= kStateWords && bag_div.numel() >= p.num_slots * p.num_features * p.max_batch,
             "pgas step: state tensors do not match the config");
  // 32-bit bag numbers and id positions, including a tile past the last bag and
  // chunks read ahead past the last id (index_dist.cu) and a grid stride past
  // the last bag (pooled_lookup.cu): both stay at or below 2^30.
  PGAS_CHECK(p.capacity <= (int64_t{1} << 30) && p.num_features * p.max_batch <= (int64_t{1} << 30),
             "pgas step: %lld ids and %lld bags per step must each stay at or below 2^30 (PgasConfig)",
             static_cast<ll>(p.capacity), static_cast<ll>(p.num_features * p.max_batch));
  PGAS_CHECK(0 <= p.lookup_f_lo && p.lookup_f_lo <= p.lookup_f_hi && p.lookup_f_hi <= p.num_features,
             "pgas step: lookup feature range [%d, %d) outside [0, %lld)", p.lookup_f_lo, p.lookup_f_hi,
             static_cast<ll>(p.num_features));
  // Peers store signals into this pad at these offsets (kernels index it by rank).
  PGAS_CHECK(pad.numel() >= kHeaderWords + kSignalGroups * p.world, "pgas step: signal pad of %lld words for %d ranks",
             static_cast<ll>(pad.numel()), p.world);
  PGAS_CHECK(batch >= 0 && batch <= p.max_batch, "pgas step: batch %lld outside [0, %lld]", static_cast<ll>(batch),
             static_cast<ll>(p.max_batch));
  PGAS_CHECK(nnz >= 0 && nnz <= p.capacity, "pgas step: %lld ids exceed the capacity of %lld", static_cast<ll>(nnz),
             static_cast<ll>(p.capacity));
  p.buf = buf.data_ptr<uint8_t>();
  p.pad = pad.data_ptr<int64_t>();
  p.peer_bufs = peers.data_ptr<int64_t>();
  p.peer_pads = peers.data_ptr<int64_t>() + p.world;
  p.features = reinterpret_cast<const FeatureDesc*>(features.data_ptr<int64_t>());
  p.state = state.data_ptr<int64_t>();
  p.bag_div = bag_div.data_ptr<float>();
  p.status = reinterpret_cast<ErrorRecord*>(status.data_ptr<int64_t>());
  p.batch = batch;
  p.nnz = nnz;
  return p;
}

// A step's outputs and gradients: float32, float16 or bfloat16.
StepFloat step_float(at::ScalarType type, const char* what) {
  switch (type) {
    case at::kFloat:
      return StepFloat::kFloat;
    case at::kHalf:
      return StepFloat::kHalf;
    case at::kBFloat16:
      return StepFloat::kBFloat16;
    default:
      PGAS_CHECK(false, "%s must be float32, float16 or bfloat16, not %s", what, c10::toString(type));
  }
  return StepFloat::kFloat;  // unreachable: the check raised
}

}  // namespace

void index_dist(const at::Tensor& values, const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                const at::Tensor& config, int64_t batch, bool give_up, bool abort_on_failure) {
  PGAS_CHECK(values.is_cuda() && offsets.is_cuda() && offsets.scalar_type() == at::kLong,
             "index_dist: CUDA values and int64 offsets expected");
  PGAS_CHECK(values.scalar_type() == at::kLong || values.scalar_type() == at::kInt,
             "index_dist: int32 or int64 ids expected");
  const StepParams p =
      make_step_params(buf, pad, peers, features, state, bag_div, status, config, batch, values.numel());
  PGAS_CHECK(offsets.numel() == p.num_features * batch + 1, "index_dist: offsets must hold F*B+1");
  PGAS_CHECK(!weights.has_value() ||
                 (weights->is_cuda() && weights->scalar_type() == at::kFloat && weights->numel() == values.numel()),
             "index_dist: weights must be float32 CUDA, one per id");
  PGAS_CHECK(p.weighted == (weights.has_value() ? 1 : 0), "index_dist: weighted mismatch");
  const int flags = (give_up ? kGiveUp : 0) | (abort_on_failure ? kAbortOnFailure : 0);
  launch_index_dist(p, values.data_ptr(), values.scalar_type() == at::kLong, offsets.data_ptr<int64_t>(),
                    weights.has_value() ? weights->data_ptr<float>() : nullptr, flags,
                    c10::cuda::getCurrentCUDAStream());
}

void pooled_lookup(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                   const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                   const at::Tensor& config, int64_t batch, int64_t max_dim, at::ScalarType out_dtype,
                   bool after_exit, bool release) {
  const StepParams p = make_step_params(buf, pad, peers, features, state, bag_div, status, config, batch, 0);
  PGAS_CHECK(max_dim > 0 && max_dim % 4 == 0, "pooled_lookup: dims must be multiples of 4, got %lld",
             static_cast<long long>(max_dim));
  int group_lanes = 4;  // at least 4 ids per chunk, even for dims below 16
  while (group_lanes < 32 && group_lanes * 4 < max_dim) group_lanes *= 2;
  launch_pooled_lookup(p, group_lanes, step_float(out_dtype, "pooled_lookup: the output dtype"), after_exit,
                       release, c10::cuda::getCurrentCUDAStream());
}

at::Tensor combine_partials(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                            const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
                            const at::Tensor& status, const at::Tensor& config, const at::Tensor& col_feature,
                            int64_t batch, at::ScalarType out_dtype) {
  const StepParams p = make_step_params(buf, pad, peers, features, state, bag_div, status, config, batch, 0);
  PGAS_CHECK(batch * p.dim_sum < (int64_t{1} << 31),
             "combine_partials: %lld x %lld outputs exceed 2^31 elements (32-bit positions)",
             static_cast<long long>(batch), static_cast<long long>(p.dim_sum));
  PGAS_CHECK(p.dim_sum % 4 == 0 && col_feature.numel() == p.dim_sum / 4 && col_feature.scalar_type() == at::kInt &&
                 col_feature.is_cuda(),
             "combine_partials: col_feature must map every 4 columns to a feature");
  const StepFloat out_type = step_float(out_dtype, "combine_partials: the output dtype");
  auto out = at::empty({batch, p.dim_sum}, buf.options().dtype(out_dtype));
  launch_combine_partials(p, out.data_ptr(), out_type, col_feature.data_ptr<int32_t>(),
                          c10::cuda::getCurrentCUDAStream());
  return out;
}

// Shapes only (fake tensors, torch.compile): [batch, 4 x the column map's vectors].
at::Tensor combine_partials_meta(const at::Tensor& buf, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor& col_feature, int64_t batch, at::ScalarType out_dtype) {
  return at::empty({batch, 4 * col_feature.numel()}, buf.options().dtype(out_dtype).device(at::kMeta));
}

void grad_dist(const at::Tensor& grad, const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
               const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
               const at::Tensor& status, const at::Tensor& config, int64_t epoch, int64_t batch, double divisor,
               bool abort) {
  const StepParams p = make_step_params(buf, pad, peers, features, state, bag_div, status, config, batch, 0);
  PGAS_CHECK(grad.is_cuda() && grad.is_contiguous() && grad.dim() == 2 && grad.size(0) == batch &&
                 grad.size(1) == p.dim_sum,
             "grad_dist: the gradient must be a contiguous CUDA [%lld, %lld] tensor", static_cast<long long>(batch),
             static_cast<long long>(p.dim_sum));
  PGAS_CHECK(epoch >= 0 && divisor >= 1.0, "grad_dist: epoch %lld, divisor %f", static_cast<long long>(epoch),
             divisor);
  PGAS_CHECK(reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16 == 0,
             "grad_dist: the gradient must start on 16 bytes (its rows are read in vectors of 4)");
  launch_grad_dist(p, grad.data_ptr(), step_float(grad.scalar_type(), "grad_dist: gradients"), epoch,
                   1.f / static_cast<float>(divisor), abort, c10::cuda::getCurrentCUDAStream());
}

void await_grads(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                 const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                 const at::Tensor& config, const at::Tensor& flags, int64_t epoch) {
  const StepParams p = make_step_params(buf, pad, peers, features, state, bag_div, status, config, 0, 0);
  PGAS_CHECK(epoch >= 0, "await_grads: epoch %lld", static_cast<long long>(epoch));
  PGAS_CHECK(flags.is_cuda() && flags.scalar_type() == at::kLong && flags.numel() >= p.world + 1,
             "await_grads: flags must be CUDA int64, one per rank and one for this rank's step");
  launch_await_grads(p, flags.data_ptr<int64_t>(), epoch, c10::cuda::getCurrentCUDAStream());
}

void release_sources(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                     const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
                     const at::Tensor& status, const at::Tensor& config, int64_t epoch) {
  const StepParams p = make_step_params(buf, pad, peers, features, state, bag_div, status, config, 0, 0);
  PGAS_CHECK(epoch >= 0, "release_sources: epoch %lld", static_cast<long long>(epoch));
  launch_release_sources(p, epoch, c10::cuda::getCurrentCUDAStream());
}

}  // namespace torchrec_pgas
