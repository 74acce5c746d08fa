// Stage 2 (owner), staged path: fused gather + pool + one-sided output write
// (rw_pool.cuh: the pooling and the checks of everything a peer wrote).
// Also make_rw_params, the parameter block of every kernel op.
//
// Serves the bags of features [lookup_f_lo, lookup_f_hi): all of them for
// pgas_row_wise, this owner's tables for pgas_table_wise, whose sources may
// each have their own batch (variable_batch: read from the source's header).
// Table-wise MEAN is pooled here with the TBE's arithmetic (kMeanOwner).
//
// Grid (ctas_per_source, W): CTA (x, k) serves source src = (rank + 1 + k) % W,
// so the remote sources' CTAs are scheduled first and the local source pads
// the tail (communication-aware ordering: the bytes that must cross NVLink
// leave first). Thread 0 waits for the source's index slot (acquire) and checks
// its header; the CTA then pools its share of the source's bags.
//
// Completion per source: fence + done counter; the last CTA of the source
// stores the epoch into the requester's output slot (st.release.sys).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "rw_pool.cuh"

namespace torchrec_pgas {

RwParams make_rw_params(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                        const at::Tensor& features, const at::Tensor& state,
                        const at::Tensor& bag_div, const at::Tensor& status,
                        at::IntArrayRef cfg, int64_t batch, int64_t nnz) {
  TORCH_CHECK(cfg.size() == kCfgEntries, "pgas_row_wise: layout config must have ", kCfgEntries, " entries");
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
  p.id_bytes = static_cast<int32_t>(cfg[17]);
  p.lookup_f_lo = static_cast<int32_t>(cfg[18]);
  p.lookup_f_hi = static_cast<int32_t>(cfg[19]);
  p.variable_batch = static_cast<int32_t>(cfg[20]);
  p.chunks = static_cast<int32_t>(cfg[21]);
  p.dist_warps = static_cast<int32_t>(cfg[22]);
  p.trace = static_cast<int32_t>(cfg[23]);
  TORCH_CHECK(p.id_bytes == 4 || p.id_bytes == 8, "pgas_row_wise: id width ", p.id_bytes, " bytes");
  TORCH_CHECK(p.world >= 1 && p.world <= kMaxWorld, "pgas_row_wise: world size ", p.world,
              " outside [1, ", kMaxWorld, "]");
  TORCH_CHECK(p.chunks >= 1 && p.chunks <= kMaxChunks && p.dist_warps >= 0 && p.dist_warps <= 8,
              "pgas: ", p.chunks, " chunks (1..", kMaxChunks, ") and ", p.dist_warps,
              " distributor warps per CTA (0..8) (PgasConfig)");
  TORCH_CHECK(pad.numel() >= kPadHeaderWords + (p.chunks + 1) * p.world, "pgas: signal pad of ", pad.numel(),
              " words is too small for ", p.chunks, " chunks");
  TORCH_CHECK(peers.numel() == 2 * p.world && features.numel() == kFeatureWords * p.num_features &&
                  state.numel() >= kStateWords &&
                  bag_div.numel() >= p.num_slots * p.num_features * p.max_batch,
              "pgas_row_wise: state tensors do not match the layout");
  // 32-bit bag numbers, including a tile past the last bag (rw_index_dist.cu) and a
  // grid stride past it (rw_lookup_kernel): bags stay at or below 2^30.
  TORCH_CHECK(p.capacity < INT32_MAX && p.num_features * p.max_batch <= (int64_t{1} << 30),
              "pgas: ", p.capacity, " ids and ", p.num_features * p.max_batch,
              " bags per step must stay below 2^31 and at most 2^30 (PgasConfig)");
  TORCH_CHECK(0 <= p.lookup_f_lo && p.lookup_f_lo <= p.lookup_f_hi && p.lookup_f_hi <= p.num_features,
              "pgas: lookup feature range [", p.lookup_f_lo, ", ", p.lookup_f_hi, ") outside [0, ",
              p.num_features, ")");
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

// Specialized on the id width and on weighting (the unweighted kernel carries no
// weight registers); registers decide how many warps hide the gather's latency.
// kTrace: the comm-timeline build (profiling); the default build has none of its code.
template <typename row_t, bool kWeighted, bool kTrace>
__global__ void __launch_bounds__(kThreads, kMinBlocks) rw_lookup_kernel(RwParams p, int group_lanes,
                                                                         int out_kind) {
  __shared__ int64_t s_epoch, s_nnz, s_batch;
  __shared__ int s_ok;
  const int k = blockIdx.y;
  const int src = (p.rank + 1 + k) % p.world;
  if (threadIdx.x == 0) {
    const int64_t epoch = p.state[kCtrLookup] + 1;
    int64_t chunk_bags;
    s_ok = check_source(p, src, epoch, p.pad + index_signal(p, 0, src), s_nnz, s_batch, chunk_bags);
    s_epoch = epoch;
  }
  __syncthreads();
  const int64_t epoch = s_epoch;
  const int64_t slot = epoch % p.num_slots;

  if (s_ok) {
    const uint8_t* block = p.buf + index_block(p, slot, src);
    // 32-bit bag and id positions (make_rw_params checks F * Bmax and C < 2^31).
    const SourceBlock<row_t> s{
        reinterpret_cast<const int64_t*>(block + p.offsets_off),
        reinterpret_cast<const int32_t*>(block + p.lengths_off),
        reinterpret_cast<const row_t*>(block + p.ids_off),
        kWeighted ? reinterpret_cast<const float*>(block + p.weights_off) : nullptr,
        reinterpret_cast<uint8_t*>(p.peer_bufs[src]) + output_block(p, slot, p.rank),
        static_cast<int>(s_nnz), static_cast<int>(s_batch)};
    const int G = group_lanes;
    const int groups_per_cta = kThreads / G;
    const int group = threadIdx.x / G;
    const int g_lane = threadIdx.x % G;
    // The group's lanes within the warp (shuffles stay inside the group).
    const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << (threadIdx.x % 32 / G * G);
    // The bags of the features whose rows this rank holds ([f][b] order, the source's batch).
    const int bag_end = p.lookup_f_hi * s.batch;
    bool bad = false, bad_span = false;
    for (int bag = p.lookup_f_lo * s.batch + blockIdx.x * groups_per_cta + group; bag < bag_end;
         bag += gridDim.x * groups_per_cta) {
      pool_one_bag<row_t, kWeighted, kTrace>(p, s, bag, G, g_lane, gmask, out_kind, src != p.rank, bad, bad_span);
    }
    // Reported once per lane, before this CTA counts as done (so before the signal).
    if (bad_span || bad) corrupt_source(p.state, p.peer_pads, p.rank, src, bad_span ? 1 : 2);
  }

  __syncthreads();
  if (threadIdx.x == 0) {
    if (last_to_arrive(p.state + kDoneSrc + k, gridDim.x)) {
      int64_t* peer_pad = reinterpret_cast<int64_t*>(p.peer_pads[src]);
      st_release_sys(peer_pad + output_signal(p, p.rank), epoch);
    }
    if (last_to_arrive(p.state + kDoneLookup, static_cast<int64_t>(gridDim.x) * gridDim.y)) {
      p.state[kCtrLookup] = epoch;
    }
  }
}

template <typename row_t, bool kWeighted, bool kTrace>
void launch_lookup(const RwParams& p, int group_lanes, int out_kind, cudaStream_t stream) {
  // One wave: W sources share the resident CTAs (one device per process, so the
  // occupancy is computed once).
  static const int resident = resident_ctas(rw_lookup_kernel<row_t, kWeighted, kTrace>, kThreads);
  const int64_t bags = std::max<int64_t>(1, (p.lookup_f_hi - p.lookup_f_lo) * p.batch);
  const int64_t groups_per_cta = kThreads / group_lanes;
  const int64_t ctas = std::max<int64_t>(
      1, std::min<int64_t>((bags + groups_per_cta - 1) / groups_per_cta, resident / p.world));
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(p.world));
  rw_lookup_kernel<row_t, kWeighted, kTrace><<<grid, kThreads, 0, stream>>>(p, group_lanes, out_kind);
}

template <typename row_t, bool kWeighted>
void launch_lookup(const RwParams& p, int group_lanes, int out_kind, cudaStream_t stream) {
  p.trace ? launch_lookup<row_t, kWeighted, true>(p, group_lanes, out_kind, stream)
          : launch_lookup<row_t, kWeighted, false>(p, group_lanes, out_kind, stream);
}

}  // namespace

void rw_lookup(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
               const at::Tensor& features, const at::Tensor& state, const at::Tensor& bag_div,
               const at::Tensor& status, at::IntArrayRef cfg, int64_t batch, int64_t max_dim,
               at::ScalarType out_dtype) {
  const RwParams p = make_rw_params(buf, pad, peers, features, state, bag_div, status, cfg, batch, 0);
  TORCH_CHECK(max_dim > 0 && max_dim % 4 == 0, "rw_lookup: dims must be multiples of 4, got ", max_dim);
  const int group_lanes = pool_group_lanes(max_dim);
  const int out_kind = out_kind_of(out_dtype);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (p.id_bytes == 4) {
    p.weighted ? launch_lookup<int32_t, true>(p, group_lanes, out_kind, stream)
               : launch_lookup<int32_t, false>(p, group_lanes, out_kind, stream);
  } else {
    p.weighted ? launch_lookup<int64_t, true>(p, group_lanes, out_kind, stream)
               : launch_lookup<int64_t, false>(p, group_lanes, out_kind, stream);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
