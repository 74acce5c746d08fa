// The backward of a step: the requester's pooled-output gradient goes one-sided
// to the owners that served each bag (grad_dist), each owner waits for its
// sources' gradients (await_grads) and, once its TBE's backward has consumed
// them with the ids it kept, releases the sources' blocks of the step
// (release_sources). The owner's TBE backward itself runs in FBGEMM.
//
// Layout written: the gradient region [slot][src] of every owner holds source
// src's gradient, [Bmax][D] in the output dtype, at the positions of the
// output block (row b, the feature's columns): the rows of the bags this owner
// held ids of, as the requester's own copy of the owner's lengths (in the
// owner's index block [slot][src]) says; other rows are not written.
//
// Arithmetic, as stock TorchRec's autograd does it on CUDA: a row-wise MEAN
// feature's gradient is divided by the bag's divisor (length or weight sum,
// + 1e-6; a tensor division), then every gradient is multiplied by 1 / the
// gradient division (the world size, or 1): PyTorch divides a CUDA tensor by a
// Python scalar as a multiplication by its fp32 reciprocal, which differs
// from a division in the last bit when W is not a power of two.
//
// Protocol: grad_dist stores the rows, fences (last-CTA pattern) and stores
// 2e into every owner's grad slot for this rank, 2e + 1 if this rank gives up
// on the step (a failed step: kStepFailed, or `abort`), having stored nothing.
// await_grads spins on the W grad slots (acquire) unless this rank's own step
// failed, and writes per source 0 (arrived), 1 (the source gave up), 2 (timed
// out) or 3 (not waited: this rank's step failed), and then 1 if this rank's
// step failed, to device memory (the owner's rebuild of its ids reads nothing
// of a step that is not whole); in a captured step it also publishes the first
// refusal or timeout as this rank's error record.
// release_sources stores e into every source's release slot: the source's
// next index dist into this slot waits for it.
// Epoch 0 names the step of this sharding's last lookup (state[kCtrLookup]):
// a training step captured in a CUDA graph runs its backward right after its
// forward, and each replay's epoch is the device's, not the one the host saw
// at capture.
#include <algorithm>

#include "step_protocol.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;

enum GradSource : int64_t { kArrived = 0, kGaveUp = 1, kTimedOut = 2, kNotWaited = 3 };

__device__ __forceinline__ int64_t step_epoch(const StepParams& p, int64_t epoch) {
  return epoch != 0 ? epoch : p.state[kCtrLookup];
}

// A warp's tile: 32 consecutive bags of one feature. For each owner of the
// feature, lane i reads the length of bag i that the owner holds (one
// coalesced read of the owner's index block), and the warp stores the rows of
// the bags with ids there, 4 columns a lane.
template <typename out_t>
__device__ __forceinline__ void send_tile(const StepParams& p, const out_t* __restrict__ grad, int64_t slot, float inv_divisor,
                                          int f, int b0) {
  const int lane = threadIdx.x % 32;
  const FeatureDesc& feat = p.features[f];
  const int batch = static_cast<int>(p.batch);
  const int b = b0 + lane;
  const bool valid = b < batch;
  const int bag = f * batch + b;
  const bool mean = feat.pooling == PoolingMode::kMeanByRequester;
  const float bag_div = valid && mean ? p.bag_div[slot * p.num_features * p.max_batch + bag] + kMeanEps : 1.f;
  const int vecs = static_cast<int>(feat.dim / 4);
  for (int o = 0; o < static_cast<int>(feat.owner_count); ++o) {
    const int owner = static_cast<int>(feat.owner_base) + o;
    const uint8_t* block = reinterpret_cast<const uint8_t*>(p.peer_bufs[owner]) + index_block(p, slot, p.rank);
    const int32_t len = valid ? __ldcg(reinterpret_cast<const int32_t*>(block + p.lengths_off) + bag) : 0;
    unsigned held = __ballot_sync(0xffffffffu, len > 0);
    out_t* dst = reinterpret_cast<out_t*>(reinterpret_cast<uint8_t*>(p.peer_bufs[owner]) + p.grad_region_off +
                                          (slot * p.world + p.rank) * p.output_block_bytes);
    while (held != 0) {
      const int i = __ffs(held) - 1;
      held &= held - 1;
      const float div_i = __shfl_sync(0xffffffffu, bag_div, i);
      const int64_t row = static_cast<int64_t>(b0 + i) * p.dim_sum + feat.out_col;
      for (int v = lane; v < vecs; v += 32) {
        float4 x = load4_cg(grad + row + 4 * v);
        if (mean) x = make_float4(x.x / div_i, x.y / div_i, x.z / div_i, x.w / div_i);
        if (inv_divisor != 1.f) x = make_float4(x.x * inv_divisor, x.y * inv_divisor, x.z * inv_divisor, x.w * inv_divisor);
        store4(dst + row + 4 * v, x);
      }
    }
  }
}

// Warps take tiles of 32 bags (a grid stride); the last CTA signals every owner.
template <typename out_t>
__global__ void __launch_bounds__(kThreads) grad_dist_kernel(StepParams p, const out_t* __restrict__ grad, int64_t epoch,
                                                            float inv_divisor, int abort) {
  epoch = step_epoch(p, epoch);
  const int64_t slot = epoch % p.num_slots;
  const bool failed = abort || p.state[kStepFailed + slot] == epoch;
  const int batch = static_cast<int>(p.batch);
  const int tiles_per_feature = (batch + 31) / 32;
  const int num_tiles = static_cast<int>(p.num_features) * tiles_per_feature;
  const int warps = static_cast<int>(gridDim.x * blockDim.x / 32);
  for (int t = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32); !failed && t < num_tiles; t += warps) {
    const int f = t / tiles_per_feature;
    send_tile(p, grad, slot, inv_divisor, f, (t - f * tiles_per_feature) * 32);
  }
  __syncthreads();
  if (threadIdx.x == 0 && last_to_arrive(p.state + kDoneGrad, gridDim.x)) {
    for (int d = 0; d < p.world; ++d) st_release_sys(peer_signal(p, d, kGradSignals), 2 * epoch + (failed ? 1 : 0));
  }
}

// A source's gradients of step `epoch`: arrived, given up by the source, or timed out (the step's deadline).
__device__ __forceinline__ int64_t await_source(const StepParams& p, int s, int64_t epoch) {
  const int64_t* slot = my_signal(p, kGradSignals, s);
  const uint64_t deadline = step_deadline_ns(p, epoch);
  int64_t seen = ld_acquire_sys(slot);
  while (seen < 2 * epoch && global_timer_ns() <= deadline) {
    seen = ld_acquire_sys(slot);
  }
  return seen < 2 * epoch ? kTimedOut : seen == 2 * epoch + 1 ? kGaveUp : kArrived;
}

// A captured step's backward has no host check after the exchange (an eager one raises the sources'
// refusals and timeouts itself): the first source that gave up or timed out becomes this rank's error
// record of the step, published to the pinned records as the combine publishes the forward's (single
// writer: the step did not fail here, so the forward published none but a warning, which an error
// replaces). Timeout stage 3: the gradients.
__device__ __forceinline__ void publish_refusal(const StepParams& p, const int64_t* flags, int64_t epoch) {
  for (int s = 0; s < p.world; ++s) {
    if (flags[s] != kGaveUp && flags[s] != kTimedOut) continue;
    ErrorRecord* status = p.status + epoch % p.num_slots;
    const bool gave_up = flags[s] == kGaveUp;
    status->a = gave_up ? s : 3;
    status->b = gave_up ? 0 : s;
    status->c = gave_up ? 0 : waited_ms(p, step_deadline_ns(p, epoch), global_timer_ns());
    status->epoch = epoch;
    __threadfence_system();
    status->code = gave_up ? ErrorCode::kPeerAbort : ErrorCode::kTimeout;
    return;
  }
}

// Thread s: source s's gradient of step `epoch` (see GradSource); thread W: this rank's step.
__global__ void await_grads_kernel(StepParams p, int64_t* flags, int64_t epoch) {
  const bool captured = epoch == 0;
  epoch = step_epoch(p, epoch);
  const int s = threadIdx.x;
  const bool failed = p.state[kStepFailed + epoch % p.num_slots] == epoch;
  if (s == p.world) flags[s] = failed ? 1 : 0;
  if (s < p.world) flags[s] = failed ? kNotWaited : await_source(p, s, epoch);
  if (captured) {  // uniform over the block
    __syncthreads();
    if (s == 0 && !failed) publish_refusal(p, flags, epoch);
  }
}

__global__ void release_sources_kernel(StepParams p, int64_t epoch) {
  epoch = step_epoch(p, epoch);
  for (int s = 0; s < p.world; ++s) st_release_sys(peer_signal(p, s, kReleaseSignals), epoch);
}

template <typename out_t>
void launch_typed(const StepParams& p, const out_t* grad, int64_t epoch, float inv_divisor, int abort,
                  cudaStream_t stream) {
  static const int resident = resident_ctas(grad_dist_kernel<out_t>, kThreads);
  const int64_t tiles = p.num_features * ((p.batch + 31) / 32);
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((tiles + kThreads / 32 - 1) / (kThreads / 32), resident)));
  grad_dist_kernel<out_t><<<grid, kThreads, 0, stream>>>(p, grad, epoch, inv_divisor, abort);
}

}  // namespace

void launch_grad_dist(const StepParams& p, const void* grad, StepFloat grad_type, int64_t epoch, float inv_divisor,
                      bool abort, cudaStream_t stream) {
  const int a = abort ? 1 : 0;
  switch (grad_type) {
    case StepFloat::kFloat:
      launch_typed(p, static_cast<const float*>(grad), epoch, inv_divisor, a, stream);
      break;
    case StepFloat::kHalf:
      launch_typed(p, static_cast<const c10::Half*>(grad), epoch, inv_divisor, a, stream);
      break;
    case StepFloat::kBFloat16:
      launch_typed(p, static_cast<const c10::BFloat16*>(grad), epoch, inv_divisor, a, stream);
      break;
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

void launch_await_grads(const StepParams& p, int64_t* flags, int64_t epoch, cudaStream_t stream) {
  await_grads_kernel<<<1, kMaxWorld + 1, 0, stream>>>(p, flags, epoch);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

void launch_release_sources(const StepParams& p, int64_t epoch, cudaStream_t stream) {
  release_sources_kernel<<<1, 1, 0, stream>>>(p, epoch);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
