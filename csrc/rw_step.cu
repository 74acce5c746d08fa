// The overlapped step (cfg dist_warps > 0): index dist and lookup in one
// persistent kernel, so the distribution (instruction-bound) runs under the
// gather (HBM-bound) instead of before it. rw_pipeline.cuh has the protocol;
// the finalize kernel (rw_finalize.cu) follows it on the stream as in the staged
// path, and the results are bit-identical to it (same per-bag pooling order).
//
// Work and roles, per CTA of kThreads:
//   warps [0, dist_warps): distributors. They claim tiles of T bags of this
//     rank's step in order (state[kTileNext]) and distribute them exactly as the
//     staged index dist does (rw_dist.cuh). The tiles are cut into chunks of
//     chunk_tiles tiles (the last one shorter); the warp that counts the last
//     tile of a chunk (state[kChunkDone + c]) fences, writes the header (whose
//     word 3 is the chunk size in bags) into every owner's copy of this rank's
//     index block, and stores the epoch into every owner's index slot [c][rank].
//     A step without bags still signals chunk 0 (CTA 0), which carries its header.
//   every warp, distributors once the tiles run out: poolers. They visit the
//     stripes (chunk c, source k) in chunk order, remote sources first (source
//     (rank + 1 + k) % W), so bytes bound for NVLink leave first. At a stripe,
//     lane 0 waits for index slot [c][src] unless the source's header says chunk
//     c is empty (the header is known from chunk 0's signal), and checks the
//     header (check_source). The warp then claims kClaimRounds bags per group at
//     a time from the stripe's counter (state[kStripeNext + c * W + k]) and pools
//     them into the requester's output block (rw_pool.cuh), until the stripe is
//     exhausted. Leaving a stripe is counted per source (state[kSrcExit + k],
//     after a fence if the warp wrote); the last of the grid's warps * C visits
//     stores the epoch into the requester's output slot.
//
// Progress: poolers wait only for distribution, and distributors never wait. A
// tile is claimed by a running warp, so every chunk is signalled even when only
// part of the grid is resident (other kernels on the GPU), on every rank.
//
// A source that fails its wait or header check is marked dead (state[kSrcDead +
// k]) and aborted; later stripes of it are skipped (no further waits), and it
// is still signalled at the end, after its abort.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "rw_dist.cuh"
#include "rw_pool.cuh"

namespace torchrec_pgas {

RwParams make_rw_params(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                        const at::Tensor& features, const at::Tensor& state,
                        const at::Tensor& bag_div, const at::Tensor& status,
                        at::IntArrayRef cfg, int64_t batch, int64_t nnz);
void check_dist_inputs(const at::Tensor& values, const at::Tensor& offsets,
                       const c10::optional<at::Tensor>& weights, const RwParams& p);

namespace {

constexpr int kWarps = kThreads / 32;
// Bags a group pools per claim of a stripe: few atomics on the stripe counter,
// short tails when a stripe runs out.
constexpr int kClaimRounds = 4;

__device__ __forceinline__ int64_t atomic_add(int64_t* word, int64_t v) {
  return static_cast<int64_t>(
      atomicAdd(reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(v)));
}

// Chunk c of this rank's step is in every owner's copy: the header, then the signal.
__device__ __forceinline__ void signal_chunk(const RwParams& p, uint8_t* const* dst, int c, int64_t epoch,
                                             int64_t chunk_bags) {
  for (int d = 0; d < p.world; ++d) write_header(p, dst[d], epoch, chunk_bags);
  __threadfence_system();
  for (int d = 0; d < p.world; ++d) {
    st_release_sys(reinterpret_cast<int64_t*>(p.peer_pads[d]) + index_signal(p, c, p.rank), epoch);
  }
}

template <typename index_t, typename row_t, bool kWeighted>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    rw_step_kernel(RwParams p, const index_t* __restrict__ values, const int64_t* __restrict__ offsets,
                   const float* __restrict__ weights, int dist_lanes, int tile_bags, int chunk_tiles,
                   int pool_lanes, int out_kind) {
  extern __shared__ int32_t s_tile[];  // [dist_warps][W][32]: TileSmem.tile_len per distributor warp
  __shared__ int32_t s_begin[kWarps][32];
  __shared__ int32_t s_owners[kWarps][32];
  __shared__ uint8_t* s_dst[kMaxWorld];  // owner d's copy of this rank's index block
  __shared__ int64_t s_epoch;
  if (threadIdx.x == 0) s_epoch = p.state[kCtrLookup] + 1;
  __syncthreads();
  const int64_t epoch = s_epoch;
  const int64_t slot = epoch % p.num_slots;
  if (threadIdx.x < p.world) {
    s_dst[threadIdx.x] = reinterpret_cast<uint8_t*>(p.peer_bufs[threadIdx.x]) + index_block(p, slot, p.rank);
  }
  __syncthreads();
  const int W = p.world, C = p.chunks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // 32-bit bag and id positions: make_rw_params checks F * Bmax and C < 2^31.
  const int num_bags = static_cast<int>(p.num_features * p.batch);
  const int num_tiles = (num_bags + tile_bags - 1) / tile_bags;
  const int64_t chunk_bags = static_cast<int64_t>(chunk_tiles) * tile_bags;

  // ---- distribution ----
  if (num_tiles == 0 && blockIdx.x == 0 && threadIdx.x == 0) signal_chunk(p, s_dst, 0, epoch, chunk_bags);
  if (warp < p.dist_warps) {
    const TileSmem smem{s_tile + warp * W * 32, s_begin[warp], s_owners[warp]};
    float* bag_div = p.bag_div + slot * p.num_features * p.max_batch;
    for (;;) {
      int tile = 0;
      if (lane == 0) tile = static_cast<int>(atomic_add(p.state + kTileNext, 1));
      tile = __shfl_sync(0xffffffffu, tile, 0);
      if (tile >= num_tiles) break;
      distribute_tile<index_t, row_t, false>(p, s_dst, values, offsets, weights, bag_div, dist_lanes, tile_bags,
                                             tile, smem);
      if (lane == 0) {  // distribute_tile ends with __syncwarp: the warp's stores precede the fence
        const int c = tile / chunk_tiles;
        const int in_chunk = min(chunk_tiles, num_tiles - c * chunk_tiles);
        if (last_to_arrive(p.state + kChunkDone + c, in_chunk)) signal_chunk(p, s_dst, c, epoch, chunk_bags);
      }
      __syncwarp();
    }
  }

  // ---- pooling ----
  const int G = pool_lanes;
  const int groups_per_warp = 32 / G;
  const int group = lane / G;
  const int g_lane = lane % G;
  const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << (group * G);
  const int claim = groups_per_warp * kClaimRounds;
  const int64_t visits = static_cast<int64_t>(gridDim.x) * kWarps * C;
  for (int c = 0; c < C; ++c) {
    for (int k = 0; k < W; ++k) {
      const int src = (p.rank + 1 + k) % W;
      const uint8_t* block = p.buf + index_block(p, slot, src);
      int64_t nnz = 0, batch = 0, cb = 0;
      int ok = 0;
      if (lane == 0 && ld_volatile(p.state + kSrcDead + k) == 0) {
        // Chunk c > 0 exists if the source's header (visible since chunk 0's signal) says so.
        const int64_t* header = reinterpret_cast<const int64_t*>(block);
        const int64_t h_batch = __ldcg(header + 1), h_chunk = __ldcg(header + 3);
        if (c == 0 || (h_chunk > 0 && c * h_chunk < p.num_features * h_batch)) {
          ok = check_source(p, src, epoch, p.pad + index_signal(p, c, src), nnz, batch, cb);
          if (ok && cb < 1 && batch > 0) {  // a staged peer (header word 3 is 0) or a corrupt one
            corrupt_source(p.state, p.peer_pads, p.rank, src, 0);
            ok = 0;
          }
          if (!ok) p.state[kSrcDead + k] = 1;
        }
      }
      ok = __shfl_sync(0xffffffffu, ok, 0);
      bool wrote = false;
      if (ok) {
        nnz = __shfl_sync(0xffffffffu, nnz, 0);
        batch = __shfl_sync(0xffffffffu, batch, 0);
        cb = __shfl_sync(0xffffffffu, cb, 0);
        const SourceBlock<row_t> s{
            reinterpret_cast<const int64_t*>(block + p.offsets_off),
            reinterpret_cast<const int32_t*>(block + p.lengths_off),
            reinterpret_cast<const row_t*>(block + p.ids_off),
            kWeighted ? reinterpret_cast<const float*>(block + p.weights_off) : nullptr,
            reinterpret_cast<uint8_t*>(p.peer_bufs[src]) + output_block(p, slot, p.rank),
            static_cast<int>(nnz), static_cast<int>(batch)};
        // The chunk's bags of the features whose rows this rank holds ([f][b], the source's batch).
        const int64_t lo64 = c * cb > p.lookup_f_lo * batch ? c * cb : p.lookup_f_lo * batch;
        int64_t hi64 = (c + 1) * cb < p.num_features * batch ? (c + 1) * cb : p.num_features * batch;
        if (hi64 > p.lookup_f_hi * batch) hi64 = p.lookup_f_hi * batch;
        const int lo = static_cast<int>(lo64), hi = static_cast<int>(hi64);
        bool bad = false, bad_span = false;
        while (lo < hi) {
          int first = 0;
          if (lane == 0) first = static_cast<int>(atomic_add(p.state + kStripeNext + c * W + k, claim));
          first = lo + __shfl_sync(0xffffffffu, first, 0);
          if (first >= hi) break;
          wrote = true;
          const int end = min(first + claim, hi);
          for (int bag = first + group; bag < end; bag += groups_per_warp) {
            pool_one_bag<row_t, kWeighted, false>(p, s, bag, G, g_lane, gmask, out_kind, src != p.rank, bad,
                                                  bad_span);
          }
        }
        if (bad_span || bad) corrupt_source(p.state, p.peer_pads, p.rank, src, bad_span ? 1 : 2);
      }
      // Leave the stripe: this warp's output stores before the count, the last visit signals.
      __syncwarp();
      if (lane == 0) {
        if (wrote) __threadfence_system();
        if (atomic_add(p.state + kSrcExit + k, 1) + 1 == visits) {
          p.state[kSrcExit + k] = 0;
          __threadfence_system();
          st_release_sys(reinterpret_cast<int64_t*>(p.peer_pads[src]) + output_signal(p, p.rank), epoch);
        }
      }
      __syncwarp();
    }
  }

  // Every warp has left every stripe: reset the claim counters for the next step.
  __syncthreads();
  if (threadIdx.x == 0 && last_to_arrive(p.state + kDoneLookup, gridDim.x)) {
    p.state[kTileNext] = 0;
    for (int i = 0; i < C * W; ++i) p.state[kStripeNext + i] = 0;
    for (int k = 0; k < W; ++k) p.state[kSrcDead + k] = 0;
    p.state[kCtrIndex] = epoch;
    p.state[kCtrLookup] = epoch;
  }
}

template <typename index_t, typename row_t, bool kWeighted>
void launch_step(const RwParams& p, const index_t* values, const int64_t* offsets, const float* weights,
                 int pool_lanes, int out_kind, cudaStream_t stream) {
  const auto kernel = rw_step_kernel<index_t, row_t, kWeighted>;
  const int smem = p.dist_warps * p.world * 32 * static_cast<int>(sizeof(int32_t));
  // One device per process: the occupancy depends on the shared memory (W and dist_warps).
  static int resident_for_smem = -1, resident = 0;
  if (resident_for_smem != smem) {
    if (smem > 48 * 1024) {
      PGAS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    resident = resident_ctas(kernel, kThreads, smem);
    resident_for_smem = smem;
  }
  const int64_t num_bags = p.num_features * p.batch;
  // Persistent: at most one wave, and about a tile per distributor warp.
  const int64_t grid = std::max<int64_t>(
      1, std::min<int64_t>(resident, (num_bags + 32 * p.dist_warps - 1) / (32 * p.dist_warps)));
  int dist_lanes, tile_bags;
  dist_shape(num_bags, p.nnz, grid * p.dist_warps, dist_lanes, tile_bags);
  // C chunks, none smaller than one tile per distributor warp (a smaller chunk hides nothing).
  const int64_t num_tiles = (num_bags + tile_bags - 1) / tile_bags;
  const int64_t chunk_tiles =
      std::max<int64_t>({1, (num_tiles + p.chunks - 1) / p.chunks, grid * p.dist_warps});
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(
      p, values, offsets, weights, dist_lanes, tile_bags, static_cast<int>(std::min<int64_t>(chunk_tiles, INT32_MAX)),
      pool_lanes, out_kind);
}

template <typename index_t>
void launch_step(const RwParams& p, const index_t* values, const int64_t* offsets, const float* weights,
                 int pool_lanes, int out_kind, cudaStream_t stream) {
  if (p.id_bytes == 4) {
    p.weighted ? launch_step<index_t, int32_t, true>(p, values, offsets, weights, pool_lanes, out_kind, stream)
               : launch_step<index_t, int32_t, false>(p, values, offsets, weights, pool_lanes, out_kind, stream);
  } else {
    p.weighted ? launch_step<index_t, int64_t, true>(p, values, offsets, weights, pool_lanes, out_kind, stream)
               : launch_step<index_t, int64_t, false>(p, values, offsets, weights, pool_lanes, out_kind, stream);
  }
}

}  // namespace

void rw_step(const at::Tensor& values, const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
             const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
             const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status, at::IntArrayRef cfg,
             int64_t batch, int64_t max_dim, at::ScalarType out_dtype) {
  const RwParams p = make_rw_params(buf, pad, peers, features, state, bag_div, status, cfg, batch,
                                    values.numel());
  check_dist_inputs(values, offsets, weights, p);
  TORCH_CHECK(p.dist_warps >= 1 && p.dist_warps <= kWarps, "rw_step: ", p.dist_warps,
              " distributor warps per CTA (1..", kWarps, "; 0 runs the staged kernels)");
  TORCH_CHECK(max_dim > 0 && max_dim % 4 == 0, "rw_step: dims must be multiples of 4, got ", max_dim);
  const int pool_lanes = pool_group_lanes(max_dim);
  const int out_kind = out_kind_of(out_dtype);
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  if (values.scalar_type() == at::kLong) {
    launch_step(p, values.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), w, pool_lanes, out_kind, stream);
  } else {
    launch_step(p, values.data_ptr<int32_t>(), offsets.data_ptr<int64_t>(), w, pool_lanes, out_kind, stream);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
