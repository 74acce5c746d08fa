// The host side of a stage launch: the op's tensors and StepConfig, checked
// against each other before a kernel takes addresses from them.
#include <ATen/core/Tensor.h>

#include "step_protocol.cuh"

namespace torchrec_pgas {

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

}  // namespace torchrec_pgas
