// Stage 1 (requester): bucketize + scatter ids straight into the owners.
//
// owner = owner_base + id / block: the row block for pgas_row_wise, the table's
// owner for pgas_table_wise (block = N, one block), see step_protocol.cuh.
//
// Layout written: this rank's index block [slot][src = rank] in every owner's
// buffer (see step_protocol.cuh). A warp takes a tile of T <= 32 consecutive
// bags of one feature (lane i holds bag i's CSR span), whose ids are one
// contiguous range [begin, end) of the local KJT's values. Feature f of the
// sharding is feature `input_feature` of the KJT (TorchRec's module permutes
// the KJT to the shardings' order otherwise: a full copy per step), so its
// bags are read there and written, to the owners, at the sharding's (f, b)
// (read_tile). A warp streams that range 32 ids at a time, one id per lane (coalesced, no lane idles on short
// bags, kAhead chunks of loads in flight), and places each id by its owner and
// local row. In owner d's copy the tile's owner-d ids are packed in stream
// order (so bag order) at the start of the tile's range: position begin +
// (owner-d ids of the tile before it), from one ballot per owner of the tile
// and the owner's cursor, held in a lane. Lane i records, in the chunk where
// bag i starts, how many owner-d ids precede it; those starts give offsets[fb]
// and lengths[fb] (differences of consecutive starts), one T-lane store per
// owner per tile. An id needs its bag (a binary search over the lanes' starts)
// only for a weight sum.
//
// NVLink writes are whole 128-byte lines: each owner's ids gather in a
// two-line ring in shared memory, indexed by position mod 64, and a line goes
// out with one 32-lane store once its last slot is filled (the first and the
// last line of a tile's run go out partial). Owner d's cursor lives in lane d;
// a row-wise feature on two GPUs keeps both cursors in every lane instead
// (stream_tile<2>: no shuffle per owner).
//
// A tile of a feature with one owner (every table-wise tile, and row-wise at
// world size 1) keeps every id at its position: it is copied, 32 ids per store,
// with no ballots and no ring (copy_tile), unless weighted or traced.
//
// Bounds: an id outside [0, N) never produces a remote write. FATAL drops it,
// records ErrorCode::kBadId (raised on the host; a one-owner copy stores row 0
// in its place) and, in a training step, gives the step up: the last CTA
// aborts it on every owner before it signals; WARNING/IGNORE read row 0
// instead (id := 0, as FBGEMM does),
// WARNING also records kBadIdWarn. Every write position lies in [begin, end) of a
// tile whose spans were checked to be a CSR inside [0, nnz], nnz <= C.
//
// Completion: fence + done counter; the last CTA writes the header, the final
// offset and the epoch into every owner's index slot, then advances the stage
// epoch (publish_index).
#include <algorithm>

#include "step_protocol.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kMaxWarps = 8;

// What the ids of a tile need from its feature (registers, warp-uniform).
struct TileBag {
  int64_t hash_size;
  int64_t block;
  int64_t magic;  // FeatureDesc::block_magic
  int32_t shift;
  int32_t feature;
  int32_t owner_base;  // the feature's owners: owner_base + [0, owner_count)
  int32_t owner_count;  // W (row-wise) or 1 (table-wise)
};

constexpr int kAhead = 3;  // chunks of 32 ids a warp has loading while it places one
constexpr int kRing = 64;  // write-combining slots per owner: two 128-byte lines of int32 rows

// Dynamic shared memory of one warp, for W owners: the bags' starts per owner
// int32[W][32], then the write-combining rings row_t[W][kRing] and, weighted,
// float[W][kRing] (8-byte aligned: the starts are 128 bytes per owner).
__host__ __device__ constexpr int warp_smem_bytes(int world, int id_bytes, bool weighted) {
  return world * 32 * 4 + world * kRing * (id_bytes + (weighted ? 4 : 0));
}

// Owner (relative to the feature's first) and local row of a checked id in
// [0, N): one 32x32->64-bit multiply-shift when N < 2^31 (a 64-bit division is
// ~20 instructions on the integer and XU pipes, per id).
__device__ __forceinline__ void locate(int64_t id, const TileBag& tb, int& owner, int64_t& row) {
  if (tb.magic != 0) {
    const uint32_t id32 = static_cast<uint32_t>(id);
    owner = static_cast<int>((static_cast<uint64_t>(id32) * static_cast<uint32_t>(tb.magic)) >> tb.shift);
    row = id32 - static_cast<uint32_t>(owner) * static_cast<uint32_t>(tb.block);
  } else {
    owner = static_cast<int>(id / tb.block);
    row = id - owner * tb.block;
  }
}

// The step this index dist runs (its last CTA advances the counter at the end):
// read on the error paths only.
__device__ __forceinline__ int64_t index_epoch(const StepParams& p) { return ld_volatile(p.state + kCtrIndex) + 1; }

// The id to place: an id outside [0, N) is dropped (-1) under FATAL, which
// records kBadId, and becomes row 0 under WARNING (recorded) and IGNORE.
// One unsigned compare: a negative id is >= 2^63.
__device__ __forceinline__ int64_t checked_id(const StepParams& p, const TileBag& tb, int64_t id) {
  if (static_cast<uint64_t>(id) < static_cast<uint64_t>(tb.hash_size)) return id;
  if (p.bounds_mode == BoundsMode::kFatal) {
    record_error(p, index_epoch(p), ErrorCode::kBadId, tb.feature, id);
    return -1;
  }
  if (p.bounds_mode == BoundsMode::kWarning) record_error(p, index_epoch(p), ErrorCode::kBadIdWarn, tb.feature, id);
  return 0;
}

// A tile whose feature has one owner (table-wise, or row-wise at world size 1):
// owner 0 holds every row (row = id), so each id keeps its position and the
// tile is a converted copy of [begin, end), every bag's span unchanged: no
// ballots, no ring, kChunks chunks of 32 ids loading at once. A bad id under
// FATAL becomes row 0 here instead of being dropped (the step raises either
// way; the positions must stay the stream's). The last chunk's lanes past
// `end` reload id end - 1 and store nothing.
template <typename index_t, typename row_t>
__device__ __forceinline__ void copy_tile(const StepParams& p, const index_t* __restrict__ values, uint8_t* dst,
                                          const TileBag& tb, int begin, int end) {
  constexpr int kChunks = 4;
  row_t* out = reinterpret_cast<row_t*>(dst + p.ids_off);
  for (int q0 = begin + static_cast<int>(threadIdx.x % 32); q0 < end; q0 += 32 * kChunks) {
    int64_t id[kChunks];
#pragma unroll
    for (int k = 0; k < kChunks; ++k) id[k] = static_cast<int64_t>(values[min(q0 + 32 * k, end - 1)]);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      if (q0 + 32 * k < end) out[q0 + 32 * k] = static_cast<row_t>(max(checked_id(p, tb, id[k]), int64_t{0}));
    }
  }
}

// Lanes [h, next head) of this lane's run of equal bags (j is non-decreasing
// across the lanes of a chunk).
__device__ __forceinline__ unsigned bag_segment(int j, int lane) {
  const int j_up = __shfl_up_sync(0xffffffffu, j, 1);
  const unsigned heads = __ballot_sync(0xffffffffu, lane == 0 || j != j_up);
  const unsigned upto = 0xffffffffu >> (31 - lane);  // lanes <= lane
  const int h = 31 - __clz(heads & upto);
  const unsigned after = heads & ~upto;
  const unsigned end_mask = after != 0 ? (1u << (__ffs(after) - 1)) - 1 : 0xffffffffu;
  return end_mask & ~((1u << h) - 1);
}

// Comm timeline: the bytes of one chunk's ids bound for other ranks, counted by
// the warp's first live lane (out of line, like trace_remote_bytes).
__device__ __noinline__ void trace_ids(int64_t* state, int rank, int bytes_per_id, int owner) {
  const unsigned remote = __ballot_sync(0xffffffffu, owner >= 0 && owner != rank);
  if (remote != 0 && threadIdx.x % 32 == __ffs(remote) - 1) trace_remote_bytes(state, __popc(remote) * bytes_per_id);
}

// Lanes store positions `at` of owner d's run from its ring (one line: coalesced).
template <bool kWeighted, typename row_t>
__device__ __forceinline__ void store_from_ring(const StepParams& p, uint8_t* dst, const row_t* ring,
                                                const float* wring, int at) {
  reinterpret_cast<row_t*>(dst + p.ids_off)[at] = ring[at & (kRing - 1)];
  if (kWeighted) reinterpret_cast<float*>(dst + p.weights_off)[at] = wring[at & (kRing - 1)];
}

// Lanes store, for each owner d whose bit is set in `full`, the line its run
// completed: the one before the run's new end (`cursor` in lane d). `dst`,
// `ring`, `wring`: from the owner of bit 0.
template <bool kWeighted, typename row_t>
__device__ __forceinline__ void store_full_lines(const StepParams& p, uint8_t* const* dst, const row_t* ring,
                                                 const float* wring, int begin, unsigned full, int cursor) {
  const int lane = threadIdx.x % 32;
  while (full != 0) {
    const int d = __ffs(full) - 1;
    full &= full - 1;
    const int at = ((begin + __shfl_sync(0xffffffffu, cursor, d)) & ~31) - 32 + lane;
    // below begin: the previous tile's ids
    if (at >= begin) store_from_ring<kWeighted>(p, dst[d], ring + d * kRing, wring + d * kRing, at);
  }
}

// One owner's cursor (ids of the tile so far that owner d holds; d relative to
// the feature's first owner) lives in lane d % 32 of `lo` (d < 32) or `hi`
// (kMaxWorld = 64).
__device__ __forceinline__ int cursor_of(int lo, int hi, int d) {
  return __shfl_sync(0xffffffffu, d < 32 ? lo : hi, d & 31);
}
__device__ __forceinline__ void cursor_add(int& lo, int& hi, int d, int n, int lane) {
  lo += lane == d ? n : 0;  // branch-free: no divergence bookkeeping in the owner loop
  hi += lane == d - 32 ? n : 0;
}


// A warp's tile: up to 32 consecutive bags of one feature, whose ids are the
// range [begin, end) of the local KJT's values; lane i holds bag i's span
// [b, e) (valid: i < n_bags).
struct Tile {
  TileBag tb;
  int begin, end, n_bags, b, e;
  bool valid;
};

// Where a warp's tile goes: owner d's copy of this rank's index block
// (dst[tb.owner_base + d]) and the warp's shared memory (warp_smem_bytes).
template <typename row_t>
struct TileScratch {
  uint8_t* const* dst;
  int32_t* starts;  // [d * 32 + i]: the tile's owner-d ids before bag i
  row_t* ring;  // [d * kRing + position % kRing]: write-combining lines
  float* wring;  // the same for the weights (weighted)
  float* div;  // [i]: bag i's weight sum (weighted)
};

// The ids of a tile, one chunk of 32 per step, kAhead chunks of loads in
// flight: chunk c's ids are placed while the next kAhead load.
template <typename index_t, bool kWeighted>
struct IdsAhead {
  int64_t id[kAhead];
  float w[kAhead];

  __device__ __forceinline__ void fill(const index_t* values, const float* weights, int begin, int end, int lane) {
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      id[k] = 0;
      w[k] = 1.f;
      if (end - begin > 32 * k + lane) {
        id[k] = static_cast<int64_t>(values[begin + 32 * k + lane]);
        if (kWeighted) w[k] = weights[begin + 32 * k + lane];
      }
    }
  }
  // Chunk q's id of this lane (q = chunk start + lane), and the load of q + 32 * kAhead issued.
  __device__ __forceinline__ void take(const index_t* values, const float* weights, int q, int end,
                                       int64_t& my_id, float& my_w) {
    my_id = id[0];
    my_w = w[0];
#pragma unroll
    for (int k = 0; k + 1 < kAhead; ++k) {
      id[k] = id[k + 1];
      w[k] = w[k + 1];
    }
    if (end - q > 32 * kAhead) {
      id[kAhead - 1] = static_cast<int64_t>(values[q + 32 * kAhead]);
      if (kWeighted) w[kAhead - 1] = weights[q + 32 * kAhead];
    }
  }
};

// Weighted: add chunk position q's weight to its bag's sum, in position order.
// The id's bag is the last bag of the tile that starts at or before q (a binary
// search over the lanes' starts); a segmented scan per chunk (lanes past the
// end form their own run) is added by the run's last lane (chunks run in
// order: deterministic).
__device__ __forceinline__ void add_weight_to_bag(const Tile& t, float* div, int q, bool live, float w) {
  const int lane = threadIdx.x % 32;
  int j = 0;
#pragma unroll
  for (int s = 16; s > 0; s /= 2) {
    const int start = __shfl_sync(0xffffffffu, t.b, (j + s) & 31);
    if (j + s < t.n_bags && start <= q) j += s;
  }
  const unsigned seg = bag_segment(live ? j : 32, lane);
  float v = live ? w : 0.f;
  const int h = __ffs(seg) - 1;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const float x = __shfl_up_sync(0xffffffffu, v, o);
    if (lane - o >= h) v += x;
  }
  if (live && (seg >> lane) == 1u) div[j] += v;
}

// The chunk starting at c: lane i records bag i's start for owner d if the bag
// starts in this chunk (`before_start`: the lanes of the chunk before it).
struct ChunkStarts {
  bool here, any;
  unsigned before_start;
  __device__ __forceinline__ ChunkStarts(const Tile& t, int c) {
    here = t.valid && static_cast<unsigned>(t.b - c) < 32u;
    any = __any_sync(0xffffffffu, here);
    before_start = (1u << ((t.b - c) & 31)) - 1;
  }
};

// Places a chunk's ids for a feature with exactly kOwners owners: every lane
// keeps all their cursors (warp-uniform registers, the owner loop unrolled), so
// no shuffle per owner and no ballot for the completed lines. One ballot per
// owner gives each id its position in its owner's run (cursor + lanes of the
// same owner below it); each lane writes its id into the ring once, and each
// completed 128-byte line goes out as one 32-lane store.
template <int kOwners, bool kWeighted, typename row_t>
__device__ __forceinline__ void place_chunk_fixed(const StepParams& p, const Tile& t, const TileScratch<row_t>& s,
                                                  const ChunkStarts& cs, int owner, int64_t row, float w,
                                                  int (&cur)[kOwners]) {
  const int lane = threadIdx.x % 32;
  const unsigned below = (1u << lane) - 1;
  int pos = 0;
  unsigned full = 0;  // warp-uniform: the owners whose run completed a line
#pragma unroll
  for (int d = 0; d < kOwners; ++d) {
    const unsigned m = __ballot_sync(0xffffffffu, owner == d);
    if (owner == d) pos = t.begin + cur[d] + __popc(m & below);
    if (cs.any && cs.here) s.starts[d * 32 + lane] = cur[d] + __popc(m & cs.before_start);
    const int was = cur[d];
    cur[d] += __popc(m);
    full |= static_cast<unsigned>(((t.begin + was) ^ (t.begin + cur[d])) >= 32) << d;
  }
  if (owner >= 0) s.ring[owner * kRing + (pos & (kRing - 1))] = static_cast<row_t>(row);
  if (kWeighted && owner >= 0) s.wring[owner * kRing + (pos & (kRing - 1))] = w;
  __syncwarp();
#pragma unroll
  for (int d = 0; d < kOwners; ++d) {
    const int at = ((t.begin + cur[d]) & ~31) - 32 + lane;
    // below begin: the previous tile's ids
    if ((full >> d & 1u) && at >= t.begin) {
      store_from_ring<kWeighted>(p, s.dst[t.tb.owner_base + d], s.ring + d * kRing, s.wring + d * kRing, at);
    }
  }
}

// Places a chunk's ids for any number of owners up to kMaxWorld, as
// place_chunk_fixed but with owner d's cursor in lane d (cursor_of): the
// completed lines come from a ballot over the cursor lanes (n <= 32 ids: at
// most one line per owner per chunk).
template <bool kWeighted, typename row_t>
__device__ __forceinline__ void place_chunk_any(const StepParams& p, const Tile& t, const TileScratch<row_t>& s,
                                                const ChunkStarts& cs, int owner, int64_t row, float w,
                                                int& cur_lo, int& cur_hi) {
  const int lane = threadIdx.x % 32;
  const unsigned below = (1u << lane) - 1;
  const int owners = t.tb.owner_count;
  const int was_lo = cur_lo, was_hi = cur_hi;
  int pos = 0;
  for (int d = 0; d < owners; ++d) {
    const unsigned m = __ballot_sync(0xffffffffu, owner == d);
    const int cur_d = cursor_of(cur_lo, cur_hi, d);
    if (owner == d) pos = t.begin + cur_d + __popc(m & below);
    if (cs.any && cs.here) s.starts[d * 32 + lane] = cur_d + __popc(m & cs.before_start);
    cursor_add(cur_lo, cur_hi, d, __popc(m), lane);
  }
  const unsigned full_lo = __ballot_sync(0xffffffffu, ((t.begin + was_lo) ^ (t.begin + cur_lo)) >= 32);
  const unsigned full_hi =
      owners > 32 ? __ballot_sync(0xffffffffu, ((t.begin + was_hi) ^ (t.begin + cur_hi)) >= 32) : 0u;
  if (owner >= 0) {
    s.ring[owner * kRing + (pos & (kRing - 1))] = static_cast<row_t>(row);
    if (kWeighted) s.wring[owner * kRing + (pos & (kRing - 1))] = w;
  }
  __syncwarp();
  uint8_t* const* dst = s.dst + t.tb.owner_base;
  store_full_lines<kWeighted>(p, dst, s.ring, s.wring, t.begin, full_lo, cur_lo);
  if (full_hi != 0) {
    store_full_lines<kWeighted>(p, dst + 32, s.ring + 32 * kRing, s.wring + 32 * kRing, t.begin, full_hi, cur_hi);
  }
}

// Streams the ids [begin, end) of a warp's tile into the owners' copies and
// leaves each owner's total in its cursor lane (cursor_of); starts[d * 32 + i]
// gets, for every bag i that starts before `end`, how many of the tile's
// owner-d ids precede it. Owner d is rank tb.owner_base + d. Ring protocol: the
// lines read by a chunk's stores can be overwritten by the next chunk's ids
// (two lines per owner), hence a __syncwarp on either side of them.
// kOwners > 0: the feature has exactly that many owners (place_chunk_fixed);
// 0: any count (place_chunk_any).
template <int kOwners, bool kWeighted, bool kTrace, typename index_t, typename row_t>
__device__ __forceinline__ void stream_tile(const StepParams& p, const index_t* __restrict__ values,
                                            const float* __restrict__ weights, const Tile& t,
                                            const TileScratch<row_t>& s, int& cur_lo, int& cur_hi) {
  const int lane = threadIdx.x % 32;
  int cur[kOwners > 0 ? kOwners : 1] = {};  // kOwners > 0: every owner's cursor, in every lane
  IdsAhead<index_t, kWeighted> ahead;
  ahead.fill(values, weights, t.begin, t.end, lane);
  for (int c = t.begin; c < t.end; c += 32) {
    const int q = c + lane;
    const bool live = q < t.end;
    int64_t id;
    float w;
    ahead.take(values, weights, q, t.end, id, w);
    int owner = -1;  // relative; -1: no id (past the end, or a dropped bad id)
    int64_t row = 0;
    if (live) {
      id = checked_id(p, t.tb, id);
      if (id >= 0) locate(id, t.tb, owner, row);
    }
    if constexpr (kTrace) {
      trace_ids(p.state, p.rank, p.id_bytes + (kWeighted ? 4 : 0), owner < 0 ? -1 : t.tb.owner_base + owner);
    }
    if constexpr (kWeighted) add_weight_to_bag(t, s.div, q, live, w);
    const ChunkStarts cs(t, c);
    if constexpr (kOwners > 0) {
      place_chunk_fixed<kOwners, kWeighted>(p, t, s, cs, owner, row, w, cur);
    } else {
      place_chunk_any<kWeighted>(p, t, s, cs, owner, row, w, cur_lo, cur_hi);
    }
    __syncwarp();
  }
  if constexpr (kOwners > 0) {  // cursor d into lane d
#pragma unroll
    for (int d = 0; d < kOwners; ++d) cur_lo = lane == d ? cur[d] : cur_lo;
  }
}

// The tile the warp claimed: its feature and bags, and their spans in the local
// KJT. Feature f of the sharding is feature `input_feature` of the KJT, so its
// bags are read there and written, to the owners, at the sharding's (f, b).
// The offsets decide addresses in the owners' buffers: they must be a CSR
// inside [0, nnz], or the tile sends nothing (an empty span, recorded).
template <typename index_t>
__device__ __forceinline__ Tile read_tile(const StepParams& p, const int64_t* __restrict__ offsets, int tile,
                                          int tiles_per_feature, int tile_bags, int& bag) {
  const int lane = threadIdx.x % 32;
  const int batch = static_cast<int>(p.batch);
  const int nnz = static_cast<int>(p.nnz);
  const int f = tile / tiles_per_feature;  // warp-uniform
  const int b0 = (tile - f * tiles_per_feature) * tile_bags;
  Tile t;
  t.n_bags = min(tile_bags, batch - b0);
  t.valid = lane < t.n_bags;
  bag = f * batch + b0 + lane;  // the sharding's bag: where the owners read it
  const FeatureDesc& feat = p.features[f];
  // input_feature < F: checked on the host (DeviceStep.read_input_order).
  const int in_bag = static_cast<int>(feat.input_feature) * batch + b0 + lane;
  int64_t b64 = 0, e64 = 0;
  if (t.valid) {
    b64 = offsets[in_bag];
    e64 = offsets[in_bag + 1];
  }
  const int64_t e_up = __shfl_up_sync(0xffffffffu, e64, 1);
  const bool span_ok = !t.valid || (b64 >= 0 && b64 <= e64 && e64 <= nnz && (lane == 0 || b64 == e_up));
  int b = static_cast<int>(b64), e = static_cast<int>(e64);
  if (!__all_sync(0xffffffffu, span_ok)) {
    if (lane == 0) record_error(p, index_epoch(p), ErrorCode::kCorrupt, p.rank, 1);
    b = e = 0;
  }
  t.b = b;
  t.e = e;
  t.begin = __shfl_sync(0xffffffffu, b, 0);
  t.end = __shfl_sync(0xffffffffu, e, t.n_bags - 1);
  t.tb = TileBag{feat.hash_size, feat.block, feat.block_magic, static_cast<int32_t>(feat.block_shift), f,
                 static_cast<int32_t>(feat.owner_base), static_cast<int32_t>(feat.owner_count)};
  return t;
}

// Per owner of a streamed tile: the partial last line of its run, then the
// bags' lengths and starts, one T-lane store each, and this rank's divisor of
// each bag (length, or weight sum).
template <bool kWeighted, bool kTrace, typename row_t>
__device__ __forceinline__ void finish_tile(const StepParams& p, const Tile& t, const TileScratch<row_t>& s, int bag,
                                            float* bag_div, int cur_lo, int cur_hi) {
  const int lane = threadIdx.x % 32;
  if (t.valid) bag_div[bag] = kWeighted ? s.div[lane] : static_cast<float>(t.e - t.b);
  for (int d = 0; d < t.tb.owner_count; ++d) {
    uint8_t* to = s.dst[t.tb.owner_base + d];
    const int total = cursor_of(cur_lo, cur_hi, d);
    const int run_end = t.begin + total;
    const int at = (run_end & ~31) + lane;
    if (at >= t.begin && at < run_end) store_from_ring<kWeighted>(p, to, s.ring + d * kRing, s.wring + d * kRing, at);
    // A bag starting at the tile's end (empty) was never in a chunk: it starts after all.
    const int start = t.valid && t.b < t.end ? s.starts[d * 32 + lane] : total;
    const int next_up = __shfl_down_sync(0xffffffffu, start, 1);
    const int next = lane == 31 ? total : next_up;
    if (t.valid) {
      reinterpret_cast<int32_t*>(to + p.lengths_off)[bag] = next - start;
      reinterpret_cast<int64_t*>(to + p.offsets_off)[bag] = t.begin + start;
      if (kTrace && t.tb.owner_base + d != p.rank) trace_remote_bytes(p.state, 12);
    }
  }
}

// Thread 0 of the last CTA: the header, the final offset and the epoch into
// every owner's index slot (after a system fence), then the stage's epoch. A
// rank that gave up on the step (`gave_up`, its abort stored first) says so in
// the header's last word: owners then check nothing else of it.
__device__ __forceinline__ void publish_index(const StepParams& p, int64_t epoch, int64_t my_block, int gave_up) {
  const int num_bags = static_cast<int>(p.num_features * p.batch);
  p.state[kTileClaims] = 0;  // every warp has made its last claim
  for (int d = 0; d < p.world; ++d) {
    uint8_t* dst = reinterpret_cast<uint8_t*>(p.peer_bufs[d]) + my_block;
    int64_t* header = reinterpret_cast<int64_t*>(dst);
    header[0] = epoch;
    header[1] = p.batch;
    header[2] = p.nnz;
    header[3] = gave_up;
    reinterpret_cast<int64_t*>(dst + p.offsets_off)[num_bags] = p.nnz;
  }
  __threadfence_system();
  for (int d = 0; d < p.world; ++d) st_release_sys(peer_signal(p, d, kIndexSignals), epoch);
  p.state[kCtrIndex] = epoch;
}

// Threads 0..W-1: wait until owner t released this rank's blocks of the step
// that last used this slot (epoch - num_slots): its lookup (a step without a
// backward) or its backward is done with them. False if an owner did not
// (timed out, recorded); the CTA then stores nothing, and this rank gives up
// on the step. The wait ignores the abort word: an abort of this step (a peer's,
// or this rank's own host give-up) says nothing about the earlier step, and
// nothing, not even an empty header, may land under an owner still reading
// that step's ids.
__device__ __forceinline__ bool owners_released(const StepParams& p, int64_t epoch, int* s_ok) {
  if (threadIdx.x == 0) *s_ok = 1;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < p.world && epoch > p.num_slots) {
    const int owner = threadIdx.x;
    const int64_t* released = my_signal(p, kReleaseSignals, owner);
    if (!wait_epoch(p, released, epoch - p.num_slots, epoch, 0, owner, /*heed_abort=*/false)) *s_ok = 0;
  }
  __syncthreads();
  return *s_ok != 0;
}

// Warps claim tiles from a counter, so an SM whose stores drain slower takes
// fewer of them instead of holding up the step's end (every CTA is resident:
// one wave). Claim k is tile (k % total_warps) * per_warp + k / total_warps:
// at any moment the grid works on every feature at once, so a table-wise
// step's stores go to all owners throughout instead of owner by owner (its
// features are in rank order). Tiles never cross a feature: a feature's bags
// are contiguous in the KJT, its neighbour in the sharding's order need not be.
struct TileClaims {
  unsigned long long* counter;
  int total_warps, per_warp, claims, num_tiles, next;

  __device__ __forceinline__ TileClaims(const StepParams& p, int num_tiles_) : num_tiles(num_tiles_) {
    counter = reinterpret_cast<unsigned long long*>(p.state + kTileClaims);
    total_warps = static_cast<int>(gridDim.x) * static_cast<int>(blockDim.x / 32);
    per_warp = (num_tiles + total_warps - 1) / total_warps;
    claims = per_warp * total_warps;
    next = threadIdx.x % 32 == 0 ? static_cast<int>(atomicAdd(counter, 1ull)) : 0;
  }
  // The next claim (-1: none left), and the one after issued (in flight during this tile).
  __device__ __forceinline__ int take() {
    const int k = __shfl_sync(0xffffffffu, next, 0);
    if (k >= claims) return -1;
    if (threadIdx.x % 32 == 0) next = static_cast<int>(atomicAdd(counter, 1ull));
    return k;
  }
  __device__ __forceinline__ int tile_of(int k) const { return (k % total_warps) * per_warp + k / total_warps; }
};

// kTrace: the comm-timeline build (profiling); the default build has none of its code.
template <typename index_t, typename row_t, bool kWeighted, bool kTrace>
__global__ void __launch_bounds__(kMaxWarps * 32, 4)
    index_dist_kernel(StepParams p, const index_t* __restrict__ values, const int64_t* __restrict__ offsets,
                      const float* __restrict__ weights, int tile_bags, int flags) {
  extern __shared__ __align__(16) uint8_t s_warps[];  // [warps][warp_smem_bytes]
  __shared__ float s_div[kMaxWarps][32];  // weighted: the bag's weight sum
  __shared__ uint8_t* s_dst[kMaxWorld];  // owner d's copy of this rank's index block
  __shared__ int64_t s_epoch;
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_epoch = p.state[kCtrIndex] + 1;
  if (kTrace && threadIdx.x == 0 && blockIdx.x == 0) {
    // Record 0: the step's start (trace_comm zeroes the counter first).
    reinterpret_cast<int64_t*>(p.state[kTraceBuf])[0] = static_cast<int64_t>(global_timer_ns());
  }
  __syncthreads();
  const int64_t epoch = s_epoch;
  const int64_t slot = epoch % p.num_slots;
  const int64_t my_block = index_block(p, slot, p.rank);
  if (threadIdx.x < p.world) s_dst[threadIdx.x] = reinterpret_cast<uint8_t*>(p.peer_bufs[threadIdx.x]) + my_block;
  const bool released = owners_released(p, epoch, &s_ok);
  if ((flags & kGiveUp) || !released) {  // owners learn at their wait for this step's data
    if (!released && threadIdx.x < p.world) abort_peer(p, threadIdx.x, epoch);
    __syncthreads();
    if (threadIdx.x == 0 && last_to_arrive(p.state + kDoneIndex, gridDim.x)) publish_index(p, epoch, my_block, 1);
    return;
  }
  const int warp = threadIdx.x / 32;
  uint8_t* my_smem = s_warps + warp * warp_smem_bytes(p.world, sizeof(row_t), kWeighted);
  TileScratch<row_t> s;
  s.dst = s_dst;
  s.starts = reinterpret_cast<int32_t*>(my_smem);
  s.ring = reinterpret_cast<row_t*>(s.starts + p.world * 32);
  s.wring = reinterpret_cast<float*>(s.ring + p.world * kRing);
  s.div = s_div[warp];
  float* bag_div = p.bag_div + slot * p.num_features * p.max_batch;
  // 32-bit bag numbers and id positions: make_step_params checks F * Bmax, C <= 2^30.
  const int tiles_per_feature = (static_cast<int>(p.batch) + tile_bags - 1) / tile_bags;
  TileClaims claims(p, static_cast<int>(p.num_features) * tiles_per_feature);
  for (int k = claims.take(); k >= 0; k = claims.take()) {
    const int tile = claims.tile_of(k);
    if (tile >= claims.num_tiles) continue;
    int bag;
    const Tile t = read_tile<index_t>(p, offsets, tile, tiles_per_feature, tile_bags, bag);
    if (!kWeighted && !kTrace && t.tb.owner_count == 1) {  // warp-uniform
      uint8_t* to = s_dst[t.tb.owner_base];
      copy_tile<index_t, row_t>(p, values, to, t.tb, t.begin, t.end);
      if (t.valid) {
        bag_div[bag] = static_cast<float>(t.e - t.b);
        reinterpret_cast<int32_t*>(to + p.lengths_off)[bag] = t.e - t.b;
        reinterpret_cast<int64_t*>(to + p.offsets_off)[bag] = t.b;
      }
      continue;
    }
    if (kWeighted) s.div[threadIdx.x % 32] = 0.f;
    __syncwarp();
    int cur_lo = 0, cur_hi = 0;
    if (!kWeighted && !kTrace && t.tb.owner_count == 2) {  // row-wise on two GPUs (warp-uniform)
      stream_tile<2, kWeighted, kTrace>(p, values, weights, t, s, cur_lo, cur_hi);
    } else {
      stream_tile<0, kWeighted, kTrace>(p, values, weights, t, s, cur_lo, cur_hi);
    }
    __syncwarp();
    finish_tile<kWeighted, kTrace>(p, t, s, bag, bag_div, cur_lo, cur_hi);
    __syncwarp();
  }
  __syncthreads();
  if (threadIdx.x == 0 && last_to_arrive(p.state + kDoneIndex, gridDim.x)) {
    // kAbortOnFailure (a training step): a step this index dist marked failed
    // (a bad id under FATAL: checked_id; a bad span; a CTA's timed-out release)
    // is given up as the host gives one up: every owner, this rank too, is
    // aborted before the signal and the header says so, so each owner's lookup
    // records the failure and the step fails on every rank by the end of its
    // forward (what a model's check before its backward reads; its backward
    // refuses the step on every rank anyway). An inference step keeps the
    // failure on its rank: the peers' outputs do not depend on its ids.
    const int gave_up = (flags & kAbortOnFailure) && ld_volatile(p.state + kStepFailed + slot) == epoch;
    if (gave_up) {
      for (int d = 0; d < p.world; ++d) abort_peer(p, d, epoch);
    }
    publish_index(p, epoch, my_block, gave_up);
  }
}

template <typename index_t, typename row_t, bool kWeighted, bool kTrace>
void launch_typed(const StepParams& p, const index_t* values, const int64_t* offsets, const float* weights,
                  int flags, cudaStream_t stream) {
  const auto kernel = index_dist_kernel<index_t, row_t, kWeighted, kTrace>;
  // Warps per CTA: 8, fewer when the owners' rings would not fit (large W).
  const int per_warp = warp_smem_bytes(p.world, sizeof(row_t), kWeighted);
  constexpr int kDynamicLimit = 160 * 1024;
  int warps = kMaxWarps;
  while (warps > 1 && warps * per_warp > kDynamicLimit) warps /= 2;
  const int smem = warps * per_warp;
  // One device per process; the occupancy depends on W (shared memory), so it
  // is recomputed when a sharding of another world size launches.
  static int resident_for_world = -1, resident = 0;
  if (resident_for_world != p.world) {
    PGAS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    resident = resident_ctas(kernel, warps * 32, smem);
    resident_for_world = p.world;
  }
  // Tiles of 32 bags of one feature, or fewer when the step is too small to fill the GPU with them.
  const auto ctas_for = [&](int64_t tile_bags) {
    return (p.num_features * ((p.batch + tile_bags - 1) / tile_bags) + warps - 1) / warps;
  };
  int tile_bags = 32;
  while (tile_bags > 1 && ctas_for(tile_bags) < resident) tile_bags /= 2;
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ctas_for(tile_bags), resident)));
  kernel<<<grid, warps * 32, smem, stream>>>(p, values, offsets, weights, tile_bags, flags);
}

template <typename index_t, bool kWeighted, bool kTrace>
void launch_typed(const StepParams& p, const index_t* values, const int64_t* offsets, const float* weights,
                  int flags, cudaStream_t stream) {
  p.id_bytes == 4 ? launch_typed<index_t, int32_t, kWeighted, kTrace>(p, values, offsets, weights, flags, stream)
                  : launch_typed<index_t, int64_t, kWeighted, kTrace>(p, values, offsets, weights, flags, stream);
}

template <typename index_t>
void launch_typed(const StepParams& p, const index_t* values, const int64_t* offsets, const float* weights,
                  int flags, cudaStream_t stream) {
  if (weights != nullptr) {
    p.trace ? launch_typed<index_t, true, true>(p, values, offsets, weights, flags, stream)
            : launch_typed<index_t, true, false>(p, values, offsets, weights, flags, stream);
  } else {
    p.trace ? launch_typed<index_t, false, true>(p, values, offsets, weights, flags, stream)
            : launch_typed<index_t, false, false>(p, values, offsets, weights, flags, stream);
  }
}

}  // namespace

void launch_index_dist(const StepParams& p, const void* values, bool ids64, const int64_t* offsets,
                       const float* weights, int flags, cudaStream_t stream) {
  if (ids64) {
    launch_typed(p, static_cast<const int64_t*>(values), offsets, weights, flags, stream);
  } else {
    launch_typed(p, static_cast<const int32_t*>(values), offsets, weights, flags, stream);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
