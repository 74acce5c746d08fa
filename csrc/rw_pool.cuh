// Pooling of one source's bags (owner side), shared by the staged lookup kernel
// (rw_lookup.cu) and the overlapped step kernel (rw_step.cu).
//
// Groups of G lanes pool one bag each: G = dim_max / 4 rounded up to a power of
// two (16 for dim 64), every lane owns 4 columns of the row (16 bytes for fp32).
// The ids of a bag are read G at a time, one per lane (coalesced, bounds-checked
// once), the next chunk prefetched while this one is pooled; each row index is
// then broadcast with a shuffle and kRowsInFlight row loads are issued before
// their sums, so a group keeps 8 rows (2 KiB at dim 64) in flight without a
// dependent load between them. The pooled vector is stored straight into the
// requester's output block [slot][owner = rank], at row b and the feature's
// column: its final layout, no unpack.
//
// Everything read from the index block came from a peer and decides an
// address: spans are checked against nnz <= C and rows against the shard's
// local rows before any load. On a bad header or a batch mismatch the source
// is skipped but still signalled (and aborted), so no rank ever hangs.
#pragma once

#include <ATen/ATen.h>

#include "rw_pipeline.cuh"

namespace torchrec_pgas {
namespace {

// 4 consecutive elements of a row of this rank's shard, widened to fp32
// (read-only for the whole kernel: the non-coherent path is fine). fp16 is the
// other weight dtype (FBGEMM 1.6's training TBE rejects bf16 weights).
template <typename w_t>
__device__ __forceinline__ float4 load4_nc(const uint8_t* p);
template <>
__device__ __forceinline__ float4 load4_nc<float>(const uint8_t* p) {
  return __ldg(reinterpret_cast<const float4*>(p));
}
template <>
__device__ __forceinline__ float4 load4_nc<__half>(const uint8_t* p) {
  return half4_to_float4(__ldg(reinterpret_cast<const uint2*>(p)));
}

constexpr int kThreads = 256;  // lookup and step kernels
constexpr int kRowsInFlight = 8;
// 16 warps per SM with 8 rows in flight each and no spills (3 blocks spilled and
// measured no faster on s000, benchmarks/NOTES.md).
constexpr int kMinBlocks = 2;

// Out of line: the error path must not cost the hot loop registers.
__device__ __noinline__ void corrupt_source(int64_t* state, const int64_t* peer_pads, int rank, int src,
                                            int what) {
  RwParams q;
  q.state = state;
  q.peer_pads = peer_pads;
  q.rank = rank;
  record_error(q, kErrCorrupt, src, what);
  abort_peer(q, src);
}

// One chunk of a bag's ids: lane g holds id g of the chunk (or -1 past the end
// or when out of the shard's rows) and, if weighted, its per-sample weight.
// A row outside the shard (it came from a peer and decides a load address)
// sets `bad`; the CTA reports it once, after its bags.
template <typename row_t, bool kWeighted>
__device__ __forceinline__ void load_ids(const row_t* ids, const float* weights, int left, int g_lane,
                                         row_t local_rows, row_t& row, float& w, bool& bad) {
  row = -1;
  w = 0.f;
  if (g_lane < left) {
    row = __ldcg(ids + g_lane);
    if (kWeighted) w = __ldcg(weights + g_lane);
    if (row < 0 || row >= local_rows) {
      bad = true;
      row = -1;
    }
  }
}

// The partial pool in the TBE's output dtype (a uniform branch, once per bag).
__device__ __forceinline__ void store_out(uint8_t* out, int64_t i, int out_kind, float4 v) {
  if (out_kind == 0) {
    store4(reinterpret_cast<float*>(out) + i, v);
  } else if (out_kind == 1) {
    store4(reinterpret_cast<c10::Half*>(out) + i, v);
  } else {
    store4(reinterpret_cast<c10::BFloat16*>(out) + i, v);
  }
}

// Pools one bag (this lane's 4 columns at byte offset `col_off`). Straight-line
// inner loop: an id past the bag's end or out of the shard's rows becomes row 0
// with weight 0, so every row load issues unconditionally, kRowsInFlight of
// them before their sums.
template <typename w_t, typename row_t, bool kWeighted>
__device__ __forceinline__ float4 pool_bag(const uint8_t* table, int row_bytes, int col_off, const row_t* bag_ids,
                                           const float* bag_w, int n, int G, int g_lane, unsigned gmask,
                                           row_t local_rows, bool& bad) {
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  row_t next_row;
  float next_w;
  load_ids<row_t, kWeighted>(bag_ids, bag_w, n, g_lane, local_rows, next_row, next_w, bad);
  for (int j0 = 0; j0 < n; j0 += G) {
    const row_t my_row = next_row < 0 ? 0 : next_row;
    const float my_w = next_row < 0 ? 0.f : (kWeighted ? next_w : 1.f);
    if (j0 + G < n) {
      load_ids<row_t, kWeighted>(bag_ids + j0 + G, kWeighted ? bag_w + j0 + G : nullptr, n - j0 - G, g_lane,
                                 local_rows, next_row, next_w, bad);
    }
    const int cnt = min(G, n - j0);
    for (int u0 = 0; u0 < cnt; u0 += kRowsInFlight) {
      float4 v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const row_t r = __shfl_sync(gmask, my_row, (u0 + u) & (G - 1), G);
        v[u] = load4_nc<w_t>(table + static_cast<int64_t>(r) * row_bytes + col_off);
      }
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const float w = __shfl_sync(gmask, my_w, (u0 + u) & (G - 1), G);
        fma4(acc, u0 + u < cnt ? w : 0.f, v[u]);
      }
    }
  }
  return acc;
}


// One source's index block as the owner reads it, after check_source.
template <typename row_t>
struct SourceBlock {
  const int64_t* offsets;
  const int32_t* lengths;
  const row_t* ids;
  const float* weights;  // weighted only
  uint8_t* out;  // the requester's output block [slot][owner = rank]
  int nnz, batch;  // checked: nnz <= C, batch <= Bmax (== this rank's unless variable_batch)
};

// Waits for index slot `signal` of source `src` and checks its header. On
// success: nnz, batch and the requester's chunk size in bags (header[3]). On a
// timeout, abort, batch mismatch or bad header it records the error, aborts
// `src` (which then stops waiting for this rank) and returns false.
__device__ __forceinline__ bool check_source(const RwParams& p, int src, int64_t epoch, const int64_t* signal,
                                             int64_t& nnz, int64_t& batch, int64_t& chunk_bags) {
  const int64_t slot = epoch % p.num_slots;
  const int64_t* header = reinterpret_cast<const int64_t*>(p.buf + index_block(p, slot, src));
  bool ok = wait_epoch(p, signal, epoch, 1, src);
  nnz = batch = chunk_bags = 0;
  // A source whose signal arrived is checked for a batch mismatch even when a
  // peer has aborted the step: both ranks of a mismatch abort each other, and
  // each must report the mismatch (record_error ranks it above the abort).
  if (ld_acquire_sys(signal) >= epoch) {
    const int64_t h_epoch = __ldcg(header), h_batch = __ldcg(header + 1), h_nnz = __ldcg(header + 2);
    const int64_t h_chunk = __ldcg(header + 3);
    if (!p.variable_batch && h_batch != p.batch) {
      record_error(p, kErrBatchMismatch, src, h_batch, p.batch);
      ok = false;
    } else if (h_epoch != epoch || h_nnz < 0 || h_nnz > p.capacity || h_batch < 0 || h_batch > p.max_batch ||
               h_chunk < 0) {
      record_error(p, kErrCorrupt, src, 0);
      ok = false;
    } else {
      nnz = h_nnz;
      batch = h_batch;
      chunk_bags = h_chunk;
    }
  }
  if (!ok) abort_peer(p, src);
  return ok;
}

// Pools bag `bag` ([f][b] order of the source's batch) of a checked source for
// this group's lanes; a bag whose span lies outside nnz sets bad_span and is not
// written, a row outside the shard sets bad (both reported by the caller).
template <typename row_t, bool kWeighted, bool kTrace>
__device__ __forceinline__ void pool_one_bag(const RwParams& p, const SourceBlock<row_t>& s, int bag, int G,
                                             int g_lane, unsigned gmask, int out_kind, bool remote, bool& bad,
                                             bool& bad_span) {
  const int f = bag / s.batch;
  const RwFeature& feat = p.features[f];
  const int64_t begin = __ldcg(s.offsets + bag);
  const int n = __ldcg(s.lengths + bag);
  if (begin < 0 || begin > s.nnz || n < 0 || n > s.nnz - begin) {
    bad_span = true;
    return;
  }
  const row_t* bag_ids = s.ids + begin;
  const float* bag_w = kWeighted ? s.weights + begin : nullptr;
  const uint8_t* table = reinterpret_cast<const uint8_t*>(feat.weights);
  const bool f32 = feat.dtype == kF32;
  const row_t local_rows = static_cast<row_t>(feat.local_rows);
  const int dim = static_cast<int>(feat.dim);
  const int row_bytes = dim * (f32 ? 4 : 2);
  for (int col0 = 0; col0 < dim; col0 += 4 * G) {  // once unless dim > 4 * 32
    const int col = col0 + 4 * g_lane;
    const bool col_ok = col < dim;
    const int col_off = (col_ok ? col : 0) * (f32 ? 4 : 2);  // idle lanes read column 0
    const float4 acc =
        f32 ? pool_bag<float, row_t, kWeighted>(table, row_bytes, col_off, bag_ids, bag_w, n, G, g_lane, gmask,
                                                local_rows, bad)
            : pool_bag<__half, row_t, kWeighted>(table, row_bytes, col_off, bag_ids, bag_w, n, G, g_lane, gmask,
                                                 local_rows, bad);
    float4 v = acc;
    if (feat.is_mean == kMeanOwner) {  // FBGEMM TBE: acc * (1.f / L), 1 for an empty bag
      const float inv_l = n != 0 ? 1.f / static_cast<float>(n) : 1.f;
      v = make_float4(acc.x * inv_l, acc.y * inv_l, acc.z * inv_l, acc.w * inv_l);
    }
    const int b = bag - f * s.batch;
    if (col_ok) store_out(s.out, static_cast<int64_t>(b) * p.dim_sum + feat.out_col + col, out_kind, v);
  }
  if constexpr (kTrace) {
    if (remote && g_lane == 0) trace_remote_bytes(p.state, feat.dim * (out_kind == 0 ? 4 : 2));
  }
}

// The pool group size: dim_max / 4 lanes rounded up to a power of two in [4, 32].
inline int pool_group_lanes(int64_t max_dim) {
  int group_lanes = 4;  // at least 4 ids per chunk, even for dims below 16
  while (group_lanes < 32 && group_lanes * 4 < max_dim) group_lanes *= 2;
  return group_lanes;
}

inline int out_kind_of(at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16,
              "pgas lookup: output dtype must be float32, float16 or bfloat16");
  return out_dtype == at::kFloat ? 0 : out_dtype == at::kHalf ? 1 : 2;
}

}  // namespace
}  // namespace torchrec_pgas
