// Stage 3 (requester): wait for the W owners, combine their partials, mean-pool.
//
// Reads the partial blocks [slot][owner] of this rank's output region, each
// already in the final [B, D] layout: a column's value is the sum, in rank
// order (fixed order: results do not depend on arrival order), of the blocks
// of the owners holding rows of its table (all W for pgas_row_wise, so a
// reduction; the one owner for pgas_table_wise, so a copy) into a fresh [B, D]
// tensor. Row-wise MEAN features divide by the bag's divisor (length or weight
// sum, + 1e-6, as TorchRec's row-wise mean) that index_dist stored in
// bag_div[slot]; table-wise MEAN was pooled by the owner.
//
// Threads 0..W-1 of every CTA spin on the W output slots (acquire), then the
// CTA streams 4-element vectors (grid-stride, kVecs per thread at a time). The
// last CTA publishes the step's ErrorRecord to pinned host memory and clears it.
#include <algorithm>

#include "step_protocol.cuh"

namespace torchrec_pgas {

namespace {

constexpr int kThreads = 256;
constexpr int kVecs = 4;

// Thread 0 waits for this step's lookup, just before on the stream, which may
// still be running (launch_after_exit): its last CTA releases the epoch this
// combine counts on its own, and with it the error record and the bag
// divisors. Threads 0..W-1 then wait for the W owners' output slots. False if
// a wait failed (recorded; the CTA then writes zeros).
__device__ __forceinline__ bool await_partials(const StepParams& p, int64_t* s_epoch, int* s_ok) {
  if (threadIdx.x == 0) {
    *s_epoch = p.state[kCtrCombine] + 1;
    *s_ok = wait_epoch(p, p.state + kCtrLookup, *s_epoch, *s_epoch, 2, p.rank) ? 1 : 0;
  }
  __syncthreads();
  if (threadIdx.x < p.world) {
    const int owner = threadIdx.x;
    if (!wait_epoch(p, my_signal(p, kOutputSignals, owner), *s_epoch, *s_epoch, 2, owner)) *s_ok = 0;
  }
  __syncthreads();
  return *s_ok != 0;
}

// kVecs vectors per thread per pass, a grid stride apart: their feature records
// are read first, then the loads of every owner's partial issue for all of them
// before the sums, so each thread keeps kVecs x owners loads in flight instead of
// one dependent chain (column -> feature -> partial) at a time. 32-bit element
// positions: combine_partials checks B x D < 2^31.
template <typename out_t>
__device__ __forceinline__ void combine_vectors(const StepParams& p, int64_t slot, bool ok, out_t* __restrict__ out,
                                                const int32_t* __restrict__ col_feature) {
  const int vecs_per_row = static_cast<int>(p.dim_sum / 4);
  const int num_vecs = static_cast<int>(p.batch) * vecs_per_row;
  const int stride = static_cast<int>(gridDim.x) * kThreads;
  const float* bag_div = p.bag_div + slot * p.num_features * p.max_batch;
  const uint8_t* blocks = p.buf + output_block(p, slot, 0);
  const int64_t block_bytes = p.output_block_bytes;
  for (int v0 = static_cast<int>(blockIdx.x) * kThreads + threadIdx.x; v0 < num_vecs; v0 += kVecs * stride) {
    int at[kVecs], f[kVecs], first[kVecs], count[kVecs];
    int owners = 0;
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const int v = v0 + u * stride;
      const int b = v / vecs_per_row;
      at[u] = v < num_vecs ? b * static_cast<int>(p.dim_sum) + (v - b * vecs_per_row) * 4 : 0;
      f[u] = v < num_vecs && ok ? col_feature[v - b * vecs_per_row] : 0;
      const FeatureDesc& feat = p.features[f[u]];
      first[u] = static_cast<int>(feat.owner_base);
      count[u] = v < num_vecs && ok ? static_cast<int>(feat.owner_count) : 0;
      owners = max(owners, count[u]);
    }
    float4 acc[kVecs];
#pragma unroll
    for (int u = 0; u < kVecs; ++u) acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int o = 0; o < owners; ++o) {  // rank order within each feature's owners
      float4 x[kVecs];
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        if (o < count[u]) x[u] = load4_cg(reinterpret_cast<const out_t*>(blocks + (first[u] + o) * block_bytes) + at[u]);
      }
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        if (o < count[u]) fma4(acc[u], 1.f, x[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const int v = v0 + u * stride;
      if (v >= num_vecs) continue;
      if (count[u] > 0 && p.features[f[u]].pooling == PoolingMode::kMeanByRequester) {
        const float d = bag_div[f[u] * p.batch + v / vecs_per_row] + kMeanEps;
        acc[u].x /= d;
        acc[u].y /= d;
        acc[u].z /= d;
        acc[u].w /= d;
      }
      store4(out + at[u], acc[u]);
    }
  }
}

// Thread 0 of the last CTA: advance the stage's epoch and publish the step's
// error record to its slot of the pinned records (single writer: plain stores),
// then clear it for the slot's next step.
__device__ __forceinline__ void publish_errors(const StepParams& p, int64_t epoch) {
  p.state[kCtrCombine] = epoch;
  int64_t* record = p.state + kErrRecords + 4 * (epoch % p.num_slots);
  if (record[0] != static_cast<int64_t>(ErrorCode::kNone)) {
    ErrorRecord* status = p.status + epoch % p.num_slots;
    status->a = record[1];
    status->b = record[2];
    status->c = record[3];
    status->epoch = epoch;
    __threadfence_system();
    status->code = static_cast<ErrorCode>(record[0]);
    for (int i = 0; i < 4; ++i) record[i] = 0;
  }
}

template <typename out_t>
__global__ void __launch_bounds__(kThreads, 3)
    combine_partials_kernel(StepParams p, out_t* __restrict__ out, const int32_t* __restrict__ col_feature) {
  __shared__ int64_t s_epoch;
  __shared__ int s_ok;
  const bool ok = await_partials(p, &s_epoch, &s_ok);
  const int64_t epoch = s_epoch;
  combine_vectors(p, epoch % p.num_slots, ok, out, col_feature);
  __syncthreads();
  if (threadIdx.x == 0 && last_to_arrive(p.state + kDoneCombine, gridDim.x)) publish_errors(p, epoch);
}

template <typename out_t>
void launch_combine(const StepParams& p, out_t* out, const int32_t* col_feature, cudaStream_t stream) {
  static const int resident = resident_ctas(combine_partials_kernel<out_t>, kThreads);
  const int64_t vecs = p.batch * p.dim_sum / 4;
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((vecs + kVecs * kThreads - 1) / (kVecs * kThreads), resident)));
  launch_after_exit(true, combine_partials_kernel<out_t>, dim3(grid), dim3(kThreads), 0, stream, p, out, col_feature);
}

}  // namespace

void launch_combine_partials(const StepParams& p, void* out, StepFloat out_type, const int32_t* col_feature,
                             cudaStream_t stream) {
  switch (out_type) {
    case StepFloat::kFloat:
      launch_combine(p, static_cast<float*>(out), col_feature, stream);
      break;
    case StepFloat::kHalf:
      launch_combine(p, static_cast<c10::Half*>(out), col_feature, stream);
      break;
    case StepFloat::kBFloat16:
      launch_combine(p, static_cast<c10::BFloat16*>(out), col_feature, stream);
      break;
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
