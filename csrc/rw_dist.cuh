// Index distribution of one tile of bags (requester side), shared by the staged
// index-dist kernel (rw_index_dist.cu) and the overlapped step kernel (rw_step.cu).
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
#pragma once

#include "rw_pipeline.cuh"

namespace torchrec_pgas {

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

// The bag's CSR span, [0, 0) past the tile or the last bag.
__device__ __forceinline__ void load_span(const int64_t* offsets, int64_t bag, int64_t end_bag, int64_t& begin,
                                          int64_t& end) {
  begin = end = 0;
  if (bag < end_bag) {
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
__device__ __noinline__ inline void trace_ids(int64_t* state, int rank, int bytes_per_id, int owner) {
  const unsigned remote = __ballot_sync(0xffffffffu, owner >= 0 && owner != rank);
  if (remote != 0 && threadIdx.x % 32 == __ffs(remote) - 1) trace_remote_bytes(state, __popc(remote) * bytes_per_id);
}

// Per-warp shared memory of a tile: tile_len[d * 32 + i] counts the ids of the
// tile's bag i that owner d holds (it is also the rank carried across chunks),
// begin[i] is the bag's checked start, owners[i] its first owner | count << 16
// (the ranks that read the bag's length and offset). All three go to the owners
// once per tile, as 32-lane stores (per bag, they were single-lane NVLink writes).
struct TileSmem {
  int32_t* tile_len;  // [W][32]
  int32_t* begin;  // [32]
  int32_t* owners;  // [32]
};

// Distributes bags [tile * T, tile * T + T) of this rank's step (the whole warp
// calls it; G lanes per bag, 32 / G bags at a time). dst[d]: owner d's copy of
// this rank's index block. bag_div: this slot's MEAN divisors.
template <typename index_t, typename row_t, bool kTrace>
__device__ __forceinline__ void distribute_tile(const RwParams& p, uint8_t* const* dst, const index_t* values,
                                                const int64_t* offsets, const float* weights, float* bag_div,
                                                int G, int T, int tile, TileSmem smem) {
  const int W = p.world;
  const int groups_per_warp = 32 / G;
  const int lane = threadIdx.x % 32;
  const int group = lane / G;
  const int g_lane = lane % G;
  const unsigned lanes_below = (1u << lane) - 1;
  const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << (group * G);
  // 32-bit bag numbers and id positions: make_rw_params checks F * Bmax and C < 2^31.
  const int num_bags = static_cast<int>(p.num_features * p.batch);
  const int batch = static_cast<int>(p.batch);
  const int nnz = static_cast<int>(p.nnz);
  const int per_tile = T / groups_per_warp;
  const int tile0 = tile * T;
  const int tile_end = min(tile0 + T, num_bags);
  for (int d = 0; d < W; ++d) smem.tile_len[d * 32 + lane] = 0;
  __syncwarp();

  // Software pipeline, one bag ahead: the next bag's span and first chunk are
  // loaded while this bag is distributed, so a bag costs no exposed load latency.
  int64_t next_begin, next_end, next_id;
  float next_w;
  load_span(offsets, tile0 + group, tile_end, next_begin, next_end);
  bool chunk_loaded = false;  // next_id / next_w hold the first chunk of this bag
  for (int sub = 0; sub < per_tile; ++sub) {
    const int in_tile = sub * groups_per_warp + group;
    const int bag = tile0 + in_tile;
    const bool valid = bag < num_bags;
    int begin = 0, n = 0;
    // The local KJT's offsets decide addresses in the owners' buffers.
    if (next_begin >= 0 && next_end >= next_begin && next_end <= nnz) {
      begin = static_cast<int>(next_begin);
      n = static_cast<int>(next_end - next_begin);
    } else {
      if (g_lane == 0) record_error(p, kErrCorrupt, p.rank, 1);
      chunk_loaded = false;
    }
    load_span(offsets, bag + groups_per_warp, tile_end, next_begin, next_end);
    const int f = valid ? bag / batch : 0;
    const RwFeature& feat = p.features[f];
    const int64_t hash_size = feat.hash_size, block = feat.block;
    const int owner_base = static_cast<int>(feat.owner_base);
    const uint64_t magic = static_cast<uint64_t>(feat.block_magic);
    const int shift = static_cast<int>(feat.block_shift);
    if (!chunk_loaded) load_chunk(values, weights, begin, n, g_lane, next_id, next_w);
    int32_t* count = smem.tile_len + in_tile;  // owner d: count[d * 32]
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
        uint8_t* d = dst[owner];
        reinterpret_cast<row_t*>(d + p.ids_off)[pos] = static_cast<row_t>(row);
        if (weights != nullptr) reinterpret_cast<float*>(d + p.weights_off)[pos] = w;
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
      smem.begin[in_tile] = begin;
      smem.owners[in_tile] = owner_base | static_cast<int32_t>(feat.owner_count) << 16;
    }
  }
  // The tile's lengths and starts, one coalesced store per owner.
  __syncwarp();
  const int b = tile0 + lane;
  if (lane < T && b < num_bags) {
    // Only the ranks holding rows of the bag's table read it (all for RW, the owner for TW).
    const int owners = smem.owners[lane];
    const int d_end = (owners & 0xffff) + (owners >> 16);
    for (int d = owners & 0xffff; d < d_end; ++d) {
      reinterpret_cast<int32_t*>(dst[d] + p.lengths_off)[b] = smem.tile_len[d * 32 + lane];
      reinterpret_cast<int64_t*>(dst[d] + p.offsets_off)[b] = smem.begin[lane];
      if (kTrace && d != p.rank) trace_remote_bytes(p.state, 12);
    }
  }
  __syncwarp();
}

// The group size and tile of a step's distribution (host): G = the mean bag
// length rounded down to a power of two in [4, 32] (a group rarely idles half its
// lanes, and short bags share a warp), tiles of 32 bags unless fewer fill
// `resident_warps` warps with one tile each.
inline void dist_shape(int64_t num_bags, int64_t nnz, int64_t resident_warps, int& group_lanes, int& tile_bags) {
  group_lanes = 4;
  while (group_lanes < 32 && 2 * group_lanes * num_bags <= nnz) group_lanes *= 2;
  tile_bags = 32;
  while (tile_bags > 32 / group_lanes && (num_bags + tile_bags - 1) / tile_bags < resident_warps) tile_bags /= 2;
}

}  // namespace torchrec_pgas
