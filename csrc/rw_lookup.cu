// pgas_row_wise stage 2 (owner): fused gather + pool + one-sided output write.
//
// Grid (ctas_per_source, W): CTA (x, k) serves source src = (rank + 1 + k) % W,
// so the remote sources' CTAs are scheduled first and the local source pads
// the tail (communication-aware ordering: the bytes that must cross NVLink
// leave first). Thread 0 waits for the source's index slot (acquire), checks
// its header, then groups of G lanes pool one bag each: G = dim_max / 4 rounded
// up to a power of two (16 for dim 64), every lane loads 4 elements of a row
// (16 bytes for fp32), several rows in flight. The pooled vector is stored
// straight into the requester's output block [slot][owner = rank], at row b
// and the feature's column: its final layout, no unpack.
//
// Everything read from the index block came from a peer and decides an
// address: spans are checked against nnz <= C and rows against the shard's
// local rows before any load. On a bad header or a batch mismatch the source
// is skipped but still signalled (and aborted), so no rank ever hangs.
//
// Completion per source: fence + done counter; the last CTA of the source
// stores the epoch into the requester's output slot (st.release.sys).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "rw_pipeline.cuh"

namespace torchrec_pgas {

RwParams make_rw_params(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                        const at::Tensor& features, const at::Tensor& state,
                        const at::Tensor& bag_div, const at::Tensor& status,
                        at::IntArrayRef cfg, int64_t batch, int64_t nnz) {
  TORCH_CHECK(cfg.size() == 17, "pgas_row_wise: layout config must have 17 entries");
  TORCH_CHECK(buf.is_cuda() && pad.is_cuda() && peers.is_cuda() && features.is_cuda() &&
                  state.is_cuda() && bag_div.is_cuda() && status.is_pinned(),
              "pgas_row_wise: device state tensors on CUDA, status pinned");
  RwParams p;
  p.buf = buf.data_ptr<uint8_t>();
  p.pad = pad.data_ptr<int64_t>();
  p.index_block_bytes = cfg[0];
  p.output_region_off = cfg[1];
  p.output_block_bytes = cfg[2];
  p.offsets_off = cfg[3];
  p.lengths_off = cfg[4];
  p.ids_off = cfg[5];
  p.weights_off = cfg[6];
  p.num_slots = cfg[7];
  p.max_batch = cfg[8];
  p.capacity = cfg[9];
  p.dim_sum = cfg[10];
  p.num_features = cfg[11];
  p.timeout_ns = cfg[12];
  p.rank = static_cast<int32_t>(cfg[13]);
  p.world = static_cast<int32_t>(cfg[14]);
  p.weighted = static_cast<int32_t>(cfg[15]);
  p.bounds_mode = static_cast<int32_t>(cfg[16]);
  TORCH_CHECK(p.world >= 1 && p.world <= kMaxWorld, "pgas_row_wise: world size ", p.world,
              " outside [1, ", kMaxWorld, "]");
  TORCH_CHECK(peers.numel() == 2 * p.world && features.numel() == 8 * p.num_features &&
                  state.numel() >= kStateWords &&
                  bag_div.numel() >= p.num_slots * p.num_features * p.max_batch,
              "pgas_row_wise: state tensors do not match the layout");
  TORCH_CHECK(batch >= 0 && batch <= p.max_batch, "pgas_row_wise: batch ", batch,
              " outside [0, ", p.max_batch, "]");
  TORCH_CHECK(nnz >= 0 && nnz <= p.capacity, "pgas_row_wise: ", nnz,
              " ids exceed the capacity of ", p.capacity);
  p.peer_bufs = peers.data_ptr<int64_t>();
  p.peer_pads = peers.data_ptr<int64_t>() + p.world;
  p.features = reinterpret_cast<const RwFeature*>(features.data_ptr<int64_t>());
  p.state = state.data_ptr<int64_t>();
  p.bag_div = bag_div.data_ptr<float>();
  p.status = status.data_ptr<int64_t>();
  p.batch = batch;
  p.nnz = nnz;
  return p;
}

namespace {

constexpr int kThreads = 256;

// 4 consecutive elements of a row of this rank's shard, widened to fp32
// (read-only for the whole kernel: the non-coherent path is fine).
__device__ __forceinline__ float4 load_row4(const RwFeature& f, int64_t row, int64_t col) {
  const int64_t i = row * f.dim + col;
  if (f.dtype == kF32) {
    return __ldg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(f.weights) + i));
  }
  // kF16 (FBGEMM 1.6's training TBE rejects bf16 weights, see rw_pipeline.py).
  return half4_to_float4(__ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const uint16_t*>(f.weights) + i)));
}

constexpr int kUnroll = 4;  // rows in flight per lane

template <typename out_t>
__global__ void __launch_bounds__(kThreads) rw_lookup_kernel(RwParams p, int group_lanes) {
  __shared__ int64_t s_epoch, s_nnz;
  __shared__ int s_ok;
  const int k = blockIdx.y;
  const int src = (p.rank + 1 + k) % p.world;
  if (threadIdx.x == 0) {
    const int64_t epoch = p.state[kCtrLookup] + 1;
    const int64_t slot = epoch % p.num_slots;
    const int64_t* header = reinterpret_cast<const int64_t*>(p.buf + index_block(p, slot, src));
    int ok = wait_epoch(p, p.pad + kPadHeaderWords + src, epoch, 1, src);
    if (ok) {
      const int64_t h_epoch = __ldcg(header), h_batch = __ldcg(header + 1), h_nnz = __ldcg(header + 2);
      if (h_batch != p.batch) {
        record_error(p, kErrBatchMismatch, src, h_batch, p.batch);
        ok = 0;
      } else if (h_epoch != epoch || h_nnz < 0 || h_nnz > p.capacity) {
        record_error(p, kErrCorrupt, src, 0);
        ok = 0;
      }
    }
    if (!ok) abort_peer(p, src);
    s_epoch = epoch;
    s_nnz = ok ? __ldcg(header + 2) : 0;  // the value checked above
    s_ok = ok;
  }
  __syncthreads();
  const int64_t epoch = s_epoch;
  const int64_t slot = epoch % p.num_slots;

  if (s_ok) {
    const uint8_t* block = p.buf + index_block(p, slot, src);
    const int64_t nnz = s_nnz;
    const int64_t* offsets = reinterpret_cast<const int64_t*>(block + p.offsets_off);
    const int32_t* lengths = reinterpret_cast<const int32_t*>(block + p.lengths_off);
    const int64_t* ids = reinterpret_cast<const int64_t*>(block + p.ids_off);
    const float* weights = p.weighted ? reinterpret_cast<const float*>(block + p.weights_off) : nullptr;
    out_t* out = reinterpret_cast<out_t*>(reinterpret_cast<uint8_t*>(p.peer_bufs[src]) +
                                          output_block(p, slot, p.rank));

    const int groups_per_cta = kThreads / group_lanes;
    const int group = threadIdx.x / group_lanes;
    const int g_lane = threadIdx.x % group_lanes;
    const int64_t num_bags = p.num_features * p.batch;
    for (int64_t bag = static_cast<int64_t>(blockIdx.x) * groups_per_cta + group; bag < num_bags;
         bag += static_cast<int64_t>(gridDim.x) * groups_per_cta) {
      const int64_t f = bag / p.batch;
      const int64_t b = bag - f * p.batch;
      const RwFeature& feat = p.features[f];
      const int64_t begin = __ldcg(offsets + bag);
      const int64_t n = __ldcg(lengths + bag);
      if (begin < 0 || begin > nnz || n < 0 || n > nnz - begin) {
        if (g_lane == 0) {
          record_error(p, kErrCorrupt, src, 1);
          abort_peer(p, src);  // its output for this bag is not written
        }
        continue;
      }
      for (int64_t col = 4 * g_lane; col < feat.dim; col += 4 * group_lanes) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int64_t j = 0; j < n; j += kUnroll) {
          int64_t rows[kUnroll];
          float ws[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const bool live = j + u < n;
            rows[u] = live ? __ldcg(ids + begin + j + u) : -1;
            ws[u] = live ? (weights ? __ldcg(weights + begin + j + u) : 1.f) : 0.f;
            if (live && (rows[u] < 0 || rows[u] >= feat.local_rows)) {
              record_error(p, kErrCorrupt, src, 2);
              abort_peer(p, src);
              rows[u] = -1;
            }
          }
          float4 v[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            v[u] = rows[u] >= 0 ? load_row4(feat, rows[u], col) : make_float4(0.f, 0.f, 0.f, 0.f);
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) fma4(acc, ws[u], v[u]);
        }
        store4(out + b * p.dim_sum + feat.out_col + col, acc);
      }
    }
  }

  __syncthreads();
  if (threadIdx.x == 0) {
    if (last_to_arrive(p.state + kDoneSrc + k, gridDim.x)) {
      int64_t* peer_pad = reinterpret_cast<int64_t*>(p.peer_pads[src]);
      st_release_sys(peer_pad + kPadHeaderWords + p.world + p.rank, epoch);
    }
    if (last_to_arrive(p.state + kDoneLookup, static_cast<int64_t>(gridDim.x) * gridDim.y)) {
      p.state[kCtrLookup] = epoch;
    }
  }
}

}  // namespace

void rw_lookup(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
               const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
               const at::Tensor& status, at::IntArrayRef cfg, int64_t batch, int64_t max_dim,
               at::ScalarType out_dtype) {
  const RwParams p = make_rw_params(buf, pad, peers, features, state, bag_div, status, cfg, batch, 0);
  TORCH_CHECK(max_dim > 0 && max_dim % 4 == 0, "rw_lookup: dims must be multiples of 4, got ", max_dim);
  int group_lanes = 1;
  while (group_lanes < 32 && group_lanes * 4 < max_dim) group_lanes *= 2;
  const int64_t groups_per_cta = kThreads / group_lanes;
  const int64_t bags = std::max<int64_t>(1, p.num_features * batch);
  // Enough CTAs per source to fill the GPU once all W sources are in flight.
  const int64_t ctas = std::max<int64_t>(
      1, std::min<int64_t>((bags + groups_per_cta - 1) / groups_per_cta, 1056 / p.world + 1));
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(p.world));
  auto stream = at::cuda::getCurrentCUDAStream();
  switch (out_dtype) {
    case at::kFloat:
      rw_lookup_kernel<float><<<grid, kThreads, 0, stream>>>(p, group_lanes);
      break;
    case at::kHalf:
      rw_lookup_kernel<at::Half><<<grid, kThreads, 0, stream>>>(p, group_lanes);
      break;
    case at::kBFloat16:
      rw_lookup_kernel<at::BFloat16><<<grid, kThreads, 0, stream>>>(p, group_lanes);
      break;
    default:
      TORCH_CHECK(false, "rw_lookup: output dtype must be float32, float16 or bfloat16");
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
