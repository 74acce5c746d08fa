// Stage 1 (requester): bucketize + scatter ids straight into the owners.
//
// owner = owner_base + id / block: the row block for pgas_row_wise, the table's
// owner for pgas_table_wise (block = N, one block), see rw_pipeline.cuh.
//
// Layout written: this rank's index block [slot][src = rank] in every owner's
// buffer (see rw_pipeline.cuh). Bag fb keeps the requester's CSR span
// [offsets[fb], offsets[fb+1]); the ids that owner d holds are packed at the
// start of that span in d's copy, as row_t local rows, and lengths[fb] says how
// many. So no scan across bags is needed: a group of G lanes (G = the mean bag
// length rounded down to a power of two in [4, 32], chosen on the host) takes one
// bag, G ids at a time. Loads run one step ahead: the next chunk of this bag,
// and the next bag's span and first chunk while this bag is stored. One ballot
// per distinct owner in the warp ranks each id among its group's ids of the
// same owner, a per-(bag, owner) count in shared memory carries the rank
// across chunks, and each id is stored straight into its owner's buffer
// through the NVLink peer pointer (lanes of one owner store consecutive slots).
// A warp takes a tile of T consecutive bags (T = 32 unless the step is small)
// and sends the tile's lengths and offsets to each owner as one T-lane store.
//
// Bounds: an id outside [0, N) never produces a remote write. FATAL drops it and
// records kErrBadId (raised on the host); WARNING/IGNORE read row 0 instead
// (id := 0, as FBGEMM does), WARNING also records kErrBadIdWarn.
//
// Completion: fence + done counter; the last CTA writes the header, the final
// offset and the epoch into every owner's index slot, then advances the stage
// epoch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "rw_pipeline.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kWarps = 8;

// One chunk of a bag: lane g's id (position at + g) and weight, if g < left.
template <typename index_t>
__device__ __forceinline__ void load_chunk(const index_t* values, const float* weights, int at, int left,
                                           int g_lane, int64_t& id, float& w) {
  id = 0;
  w = 1.f;
  if (g_lane < left) {
    id = static_cast<int64_t>(values[at + g_lane]);
    if (weights != nullptr) w = weights[at + g_lane];
  }
}

// The bag's CSR span, [0, 0) past the last bag.
__device__ __forceinline__ void load_span(const int64_t* offsets, int64_t bag, int64_t num_bags, int64_t& begin,
                                          int64_t& end) {
  begin = end = 0;
  if (bag < num_bags) {
    begin = offsets[bag];
    end = offsets[bag + 1];
  }
}

// Owner and local row of a checked id in [0, N): a multiply-shift when N < 2^31
// (a division is ~20 instructions on the integer and XU pipes, per id).
__device__ __forceinline__ void locate(int64_t id, int64_t block, uint64_t magic, int shift, int& owner,
                                       int64_t& row) {
  owner = magic != 0 ? static_cast<int>((static_cast<uint64_t>(id) * magic) >> shift)
                     : static_cast<int>(id / block);
  row = id - owner * block;
}

// Lanes of this lane's group with the same owner (0 for owner < 0). One ballot
// per distinct owner in the warp (match.any is far slower, and W is small).
__device__ __forceinline__ unsigned same_owner_lanes(int owner, unsigned gmask) {
  unsigned pending = __ballot_sync(0xffffffffu, owner >= 0);
  unsigned same = 0;
  while (pending != 0) {
    const int d = __shfl_sync(0xffffffffu, owner, __ffs(pending) - 1);
    const unsigned m = __ballot_sync(0xffffffffu, owner == d);
    if (owner == d) same = m & gmask;
    pending &= ~m;
  }
  return same;
}

// Comm timeline: the bytes of one chunk's ids bound for other ranks, counted by
// the warp's first live lane (out of line, like trace_remote_bytes).
// Scalars only: a reference to the kernel's RwParams would put a copy of it on the stack.
__device__ __noinline__ void trace_ids(int64_t* state, int rank, int bytes_per_id, int owner) {
  const unsigned remote = __ballot_sync(0xffffffffu, owner >= 0 && owner != rank);
  if (remote != 0 && threadIdx.x % 32 == __ffs(remote) - 1) trace_remote_bytes(state, __popc(remote) * bytes_per_id);
}

// kTrace: the comm-timeline build (profiling); the default build has none of its code.
template <typename index_t, typename row_t, bool kTrace>
__global__ void __launch_bounds__(kWarps * 32, 4)
    rw_index_dist_kernel(RwParams p, const index_t* __restrict__ values,
                         const int64_t* __restrict__ offsets, const float* __restrict__ weights,
                         int group_lanes, int tile_bags) {
  // Per warp, a tile of T <= 32 consecutive bags: tile_len[d * 32 + i] counts the ids
  // of the tile's bag i that owner d holds (it is also the rank carried across
  // chunks), s_begin[warp][i] the bag's checked start. Both go to the owners
  // once per tile, as 32-lane stores (per bag, they were single-lane NVLink writes).
  extern __shared__ int32_t s_tile[];  // [kWarps][W][32]
  __shared__ int32_t s_begin[kWarps][32];
  __shared__ int32_t s_owners[kWarps][32];  // the bag's first owner | owner count << 16
  __shared__ uint8_t* s_dst[kMaxWorld];  // owner d's copy of this rank's index block
  __shared__ int64_t s_epoch;
  if (threadIdx.x == 0) s_epoch = p.state[kCtrIndex] + 1;
  if (kTrace && threadIdx.x == 0 && blockIdx.x == 0) {
    // Record 0: the step's start (profiling.comm_timeline zeroes the counter first).
    reinterpret_cast<int64_t*>(p.state[kTraceBuf])[0] = static_cast<int64_t>(global_timer_ns());
  }
  __syncthreads();
  const int64_t epoch = s_epoch;
  const int64_t slot = epoch % p.num_slots;
  const int64_t my_block = index_block(p, slot, p.rank);
  if (threadIdx.x < p.world) s_dst[threadIdx.x] = reinterpret_cast<uint8_t*>(p.peer_bufs[threadIdx.x]) + my_block;
  __syncthreads();
  const int W = p.world;
  const int G = group_lanes;
  const int groups_per_warp = 32 / G;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = lane / G;
  const int g_lane = lane % G;
  const unsigned lanes_below = (1u << lane) - 1;
  const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << (group * G);
  int32_t* tile_len = s_tile + warp * W * 32;
  // 32-bit bag numbers and id positions: make_rw_params checks F * Bmax and C < 2^31.
  const int num_bags = static_cast<int>(p.num_features * p.batch);
  const int batch = static_cast<int>(p.batch);
  const int nnz = static_cast<int>(p.nnz);
  float* bag_div = p.bag_div + slot * p.num_features * p.max_batch;
  // Warp iteration `it` takes bag (sub * groups_per_warp + group) of tile
  // it / per_tile, sub = it % per_tile; warp gw owns tiles gw, gw + total_warps, ...
  const int T = tile_bags;
  const int per_tile = T / groups_per_warp;
  const int64_t total_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const auto bag_of = [&](int64_t it) {
    return ((it / per_tile) * total_warps + gw) * T + (it % per_tile) * groups_per_warp + group;
  };

  // Software pipeline, one bag ahead: the next bag's span and first chunk are
  // loaded while this bag is distributed, so a bag costs no exposed load latency.
  int64_t next_begin, next_end, next_id;
  float next_w;
  load_span(offsets, bag_of(0), num_bags, next_begin, next_end);
  bool chunk_loaded = false;  // next_id / next_w hold the first chunk of this bag
  for (int64_t it = 0;; ++it) {
    const int64_t tile = (it / per_tile) * total_warps + gw;
    if (tile * T >= num_bags) break;  // warp-uniform
    const int sub = static_cast<int>(it % per_tile);
    const int in_tile = sub * groups_per_warp + group;
    const int bag = static_cast<int>(tile * T) + in_tile;
    const bool valid = bag < num_bags;
    if (sub == 0) {
      for (int d = 0; d < W; ++d) tile_len[d * 32 + lane] = 0;
      __syncwarp();
    }
    int begin = 0, n = 0;
    // The local KJT's offsets decide addresses in the owners' buffers.
    if (next_begin >= 0 && next_end >= next_begin && next_end <= nnz) {
      begin = static_cast<int>(next_begin);
      n = static_cast<int>(next_end - next_begin);
    } else {
      if (g_lane == 0) record_error(p, kErrCorrupt, p.rank, 1);
      chunk_loaded = false;
    }
    load_span(offsets, bag_of(it + 1), num_bags, next_begin, next_end);
    const int f = valid ? bag / batch : 0;
    const RwFeature& feat = p.features[f];
    const int64_t hash_size = feat.hash_size, block = feat.block;
    const int owner_base = static_cast<int>(feat.owner_base);
    const uint64_t magic = static_cast<uint64_t>(feat.block_magic);
    const int shift = static_cast<int>(feat.block_shift);
    if (!chunk_loaded) load_chunk(values, weights, begin, n, g_lane, next_id, next_w);
    int32_t* count = tile_len + in_tile;  // owner d: count[d * 32]
    float divisor = 0.f;  // bag length, or the sum of its weights
    const int longest = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(n));
    for (int j0 = 0; j0 < longest; j0 += G) {
      int64_t id = next_id;
      const float w = next_w;
      const bool live = j0 + g_lane < n;
      if (j0 + G < n) load_chunk(values, weights, begin + j0 + G, n - j0 - G, g_lane, next_id, next_w);
      int owner = -1;
      int64_t row = 0;
      if (live) {
        divisor += w;
        if (id < 0 || id >= hash_size) {
          if (p.bounds_mode == kBoundsFatal) {
            record_error(p, kErrBadId, f, id);
            id = -1;
          } else {
            if (p.bounds_mode == kBoundsWarning) record_error(p, kErrBadIdWarn, f, id);
            id = 0;
          }
        }
        if (id >= 0) {
          locate(id, block, magic, shift, owner, row);
          owner += owner_base;
        }
      }
      if constexpr (kTrace) trace_ids(p.state, p.rank, p.id_bytes + (weights != nullptr ? 4 : 0), owner);
      const unsigned same = same_owner_lanes(owner, gmask);
      const int base = owner >= 0 ? count[owner * 32] : 0;
      __syncwarp();
      if (owner >= 0) {
        const int pos = begin + base + __popc(same & lanes_below);
        uint8_t* dst = s_dst[owner];
        reinterpret_cast<row_t*>(dst + p.ids_off)[pos] = static_cast<row_t>(row);
        if (weights != nullptr) reinterpret_cast<float*>(dst + p.weights_off)[pos] = w;
        if ((same & lanes_below) == 0) count[owner * 32] = base + __popc(same);
      }
      __syncwarp();
    }
    // The next bag's first chunk, when its span is sane (checked again above).
    chunk_loaded = next_begin >= 0 && next_end >= next_begin && next_end <= nnz;
    if (chunk_loaded) {
      load_chunk(values, weights, static_cast<int>(next_begin), static_cast<int>(next_end - next_begin), g_lane,
                 next_id, next_w);
    }
    for (int o = G / 2; o > 0; o /= 2) divisor += __shfl_xor_sync(0xffffffffu, divisor, o);
    if (valid && g_lane == 0) {
      bag_div[bag] = divisor;
      s_begin[warp][in_tile] = begin;
      s_owners[warp][in_tile] = owner_base | static_cast<int32_t>(feat.owner_count) << 16;
    }
    if (sub == per_tile - 1) {  // the tile's lengths and starts, one coalesced store per owner
      __syncwarp();
      const int b = static_cast<int>(tile * T) + lane;
      if (lane < T && b < num_bags) {
        // Only the ranks holding rows of the bag's table read it (all for RW, the owner for TW).
        const int owners = s_owners[warp][lane];
        const int d_end = (owners & 0xffff) + (owners >> 16);
        for (int d = owners & 0xffff; d < d_end; ++d) {
          reinterpret_cast<int32_t*>(s_dst[d] + p.lengths_off)[b] = tile_len[d * 32 + lane];
          reinterpret_cast<int64_t*>(s_dst[d] + p.offsets_off)[b] = s_begin[warp][lane];
          if (kTrace && d != p.rank) trace_remote_bytes(p.state, 12);
        }
      }
      __syncwarp();
    }
  }

  __syncthreads();
  if (threadIdx.x == 0 && last_to_arrive(p.state + kDoneIndex, gridDim.x)) {
    for (int d = 0; d < p.world; ++d) {
      uint8_t* dst = reinterpret_cast<uint8_t*>(p.peer_bufs[d]) + my_block;
      int64_t* header = reinterpret_cast<int64_t*>(dst);
      header[0] = epoch;
      header[1] = p.batch;
      header[2] = p.nnz;
      header[3] = 0;
      reinterpret_cast<int64_t*>(dst + p.offsets_off)[num_bags] = p.nnz;
    }
    __threadfence_system();
    for (int d = 0; d < p.world; ++d) {
      int64_t* peer_pad = reinterpret_cast<int64_t*>(p.peer_pads[d]);
      st_release_sys(peer_pad + kPadHeaderWords + p.rank, epoch);
    }
    p.state[kCtrIndex] = epoch;
  }
}

template <typename index_t, typename row_t, bool kTrace>
void launch_index_dist(const RwParams& p, const index_t* values, const int64_t* offsets,
                       const float* weights, cudaStream_t stream) {
  const int64_t num_bags = p.num_features * p.batch;
  // G = the mean bag length rounded down to a power of two in [4, 32]: a group
  // rarely idles half its lanes, and short bags share a warp (more loads in flight).
  int group_lanes = 4;
  while (group_lanes < 32 && 2 * group_lanes * num_bags <= p.nnz) group_lanes *= 2;
  const auto kernel = rw_index_dist_kernel<index_t, row_t, kTrace>;
  const int smem = kWarps * p.world * 32 * static_cast<int>(sizeof(int32_t));  // W KiB
  // One device per process; the occupancy depends on W (shared memory), so it is
  // recomputed when a sharding of another world size launches.
  static int resident_for_world = -1, resident = 0;
  if (resident_for_world != p.world) {
    if (smem > 48 * 1024) {
      PGAS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    resident = resident_ctas(kernel, kWarps * 32, smem);
    resident_for_world = p.world;
  }
  // Tiles of 32 bags, or fewer when the step is too small to fill the GPU with them.
  int tile_bags = 32;
  while (tile_bags > 32 / group_lanes && (num_bags + kWarps * tile_bags - 1) / (kWarps * tile_bags) < resident) {
    tile_bags /= 2;
  }
  const int64_t bags_per_cta = kWarps * tile_bags;
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((num_bags + bags_per_cta - 1) / bags_per_cta, resident)));
  kernel<<<grid, kWarps * 32, smem, stream>>>(p, values, offsets, weights, group_lanes, tile_bags);
}

template <typename index_t>
void launch_index_dist(const RwParams& p, const index_t* values, const int64_t* offsets,
                       const float* weights, cudaStream_t stream) {
  if (p.trace) {
    p.id_bytes == 4 ? launch_index_dist<index_t, int32_t, true>(p, values, offsets, weights, stream)
                    : launch_index_dist<index_t, int64_t, true>(p, values, offsets, weights, stream);
  } else {
    p.id_bytes == 4 ? launch_index_dist<index_t, int32_t, false>(p, values, offsets, weights, stream)
                    : launch_index_dist<index_t, int64_t, false>(p, values, offsets, weights, stream);
  }
}

}  // namespace

RwParams make_rw_params(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                        const at::Tensor& features, const at::Tensor& state,
                        const at::Tensor& bag_div, const at::Tensor& status,
                        at::IntArrayRef cfg, int64_t batch, int64_t nnz);

void rw_index_dist(const at::Tensor& values, const at::Tensor& offsets,
                   const c10::optional<at::Tensor>& weights, const at::Tensor& buf,
                   const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                   const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                   at::IntArrayRef cfg, int64_t batch) {
  TORCH_CHECK(values.is_cuda() && offsets.is_cuda() && offsets.scalar_type() == at::kLong,
              "rw_index_dist: CUDA values and int64 offsets expected");
  const RwParams p = make_rw_params(buf, pad, peers, features, state, bag_div, status, cfg, batch,
                                    values.numel());
  TORCH_CHECK(offsets.numel() == p.num_features * batch + 1, "rw_index_dist: offsets must hold F*B+1");
  TORCH_CHECK(!weights.has_value() || (weights->is_cuda() && weights->scalar_type() == at::kFloat &&
                                       weights->numel() == values.numel()),
              "rw_index_dist: weights must be float32 CUDA, one per id");
  TORCH_CHECK(p.weighted == (weights.has_value() ? 1 : 0), "rw_index_dist: weighted mismatch");
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  if (values.scalar_type() == at::kLong) {
    launch_index_dist(p, values.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), w, stream);
  } else {
    TORCH_CHECK(values.scalar_type() == at::kInt, "rw_index_dist: int32 or int64 ids expected");
    launch_index_dist(p, values.data_ptr<int32_t>(), offsets.data_ptr<int64_t>(), w, stream);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
