// Stage 2 (owner): fused gather + pool + one-sided output write.
//
// Serves the bags of features [lookup_f_lo, lookup_f_hi): all of them for
// pgas_row_wise, this owner's tables for pgas_table_wise, whose sources may
// each have their own batch (variable_batch: read from the source's header).
// Table-wise MEAN is pooled here with the TBE's arithmetic (kMeanByOwner).
//
// Grid (ctas_per_source, W): CTA (x, k) serves source src = (rank + 1 + k) % W,
// so the remote sources' CTAs are scheduled first and the local source pads
// the tail (the bytes that must cross NVLink leave first). Thread 0 waits for
// the source's index slot (acquire) and checks its header (accept_source), then
// groups of G lanes pool one bag at a time (BagQueue): G = dim_max / 4 rounded
// up to a power of two (16 for dim 64), every lane owns 4 columns of the row
// (16 bytes for fp32). The ids of a bag are read G at a time, one per lane
// (coalesced, bounds-checked once), the next chunk loading while this one is
// pooled; each row index is then broadcast with a shuffle. Rows are copied into
// shared memory (cp.async) in rounds of kRowsInFlight, kStages rounds in flight
// per group while the oldest is summed (pool_bag). The pooled vector is stored
// straight into the requester's output block [slot][owner = rank], at row b and
// the feature's column: its final layout, no unpack.
//
// Everything read from the index block came from a peer and decides an
// address: spans are checked against nnz <= C and rows against the shard's
// local rows before any load. On a bad header or a batch mismatch the source
// is skipped but still signalled (and aborted), so no rank ever hangs.
//
// Completion per source: fence + done counter; the last CTA of the source
// stores the epoch into the requester's output slot (st.release.sys).
#include <algorithm>

#include "step_protocol.cuh"

namespace torchrec_pgas {

namespace {

constexpr int kThreads = 256;

constexpr int kRowsInFlight = 8;
constexpr int kClaimBags = 8;  // consecutive bags per claim: one atomic in flight per unit of a group
// 16 warps per SM without spills, and 2 x kStageBytes (128 KiB) of row stages.
constexpr int kMinBlocks = 2;

// Out of line: the error path must not cost the hot loop registers.
__device__ __noinline__ void corrupt_source(int64_t* state, const int64_t* peer_pads, int rank, int64_t num_slots,
                                            int src, int what, int64_t epoch) {
  StepParams q;
  q.state = state;
  q.peer_pads = peer_pads;
  q.rank = rank;
  q.num_slots = num_slots;
  record_error(q, epoch, ErrorCode::kCorrupt, src, what);
  abort_peer(q, src, epoch);
}

// One chunk of a bag's ids: lane g loads id g of the chunk and, if weighted,
// its per-sample weight (lanes past the end load nothing). Unchecked: a
// prefetched chunk is checked where it is used (check_row), so that the load
// stays in flight until then.
template <typename row_t, bool kWeighted>
__device__ __forceinline__ void load_ids(const row_t* ids, const float* weights, int left, int g_lane, row_t& row,
                                         float& w) {
  row = 0;
  w = 0.f;
  if (g_lane < left) {
    row = __ldcg(ids + g_lane);
    if (kWeighted) w = __ldcg(weights + g_lane);
  }
}

// A loaded row of a chunk of `cnt` ids, as the pool uses it: a row outside the
// shard (it came from a peer and decides a load address) sets `bad` (the CTA
// reports it once, after its bags) and, like a lane past the end, becomes
// row 0 with weight 0.
template <typename row_t, bool kWeighted>
__device__ __forceinline__ void check_row(row_t row, float w, int cnt, int g_lane, row_t local_rows, row_t& my_row,
                                          float& my_w, bool& bad) {
  const bool live = g_lane < cnt;
  const bool in_shard = row >= 0 && row < local_rows;
  if (live && !in_shard) bad = true;
  my_row = live && in_shard ? row : 0;
  my_w = live && in_shard ? (kWeighted ? w : 1.f) : 0.f;
}

// The partial pool in the TBE's output dtype, `out_kind` a StepFloat (a uniform branch, once per bag).
__device__ __forceinline__ void store_out(uint8_t* out, int64_t i, int out_kind, float4 v) {
  if (out_kind == static_cast<int>(StepFloat::kFloat)) {
    store4(reinterpret_cast<float*>(out) + i, v);
  } else if (out_kind == static_cast<int>(StepFloat::kHalf)) {
    store4(reinterpret_cast<c10::Half*>(out) + i, v);
  } else {
    store4(reinterpret_cast<c10::BFloat16*>(out) + i, v);
  }
}

// Rows in flight go through shared memory (cp.async), not registers: a group
// keeps kStages rounds of kRowsInFlight rows loading while it sums the oldest.
// Each lane copies and later reads only its own 16 bytes (4 columns) of each
// row, so a lane's own cp.async.wait_group orders its reads: no barrier.
// Stage layout (dynamic shared memory, kStageBytes per CTA):
// [stage][slot u][thread] 16-byte cells, consecutive threads in consecutive
// cells (conflict-free 16-byte accesses). The copies allocate in L1
// (cp.async.ca): under skew many bags of one CTA read the same hot rows, which
// then hit in the SM's L1 instead of all landing on the one L2 slice that
// holds each row.
constexpr int kStages = 2;
constexpr int kStageBytes = kStages * kRowsInFlight * kThreads * 16;

template <typename w_t>
__device__ __forceinline__ void copy_async(uint32_t cell, const uint8_t* src);
template <>
__device__ __forceinline__ void copy_async<float>(uint32_t cell, const uint8_t* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(cell), "l"(src) : "memory");
}
template <>
__device__ __forceinline__ void copy_async<__half>(uint32_t cell, const uint8_t* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(cell), "l"(src) : "memory");
}

template <typename w_t>
__device__ __forceinline__ float4 load_cell(uint32_t cell);
template <>
__device__ __forceinline__ float4 load_cell<float>(uint32_t cell) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(cell));
  return v;
}
template <>
__device__ __forceinline__ float4 load_cell<__half>(uint32_t cell) {
  uint2 raw;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(raw.x), "=r"(raw.y) : "r"(cell));
  return half4_to_float4(raw);
}

// Adds the `cnt` live slots of a landed round in slot order (the TBE's order:
// bit-exact sums), each with its weight (0 for a row outside the shard).
template <typename w_t>
__device__ __forceinline__ void sum_round(float4& acc, uint32_t stage, const float (&w)[kRowsInFlight], int cnt) {
#pragma unroll
  for (int u = 0; u < kRowsInFlight; ++u) {
    if (u < cnt) fma4(acc, w[u], load_cell<w_t>(stage + u * kThreads * 16));  // dead slots: never added
  }
}

// Pools one bag (this lane's 4 columns at byte offset `col_off`) in rounds of
// kRowsInFlight rows: round i's copies are issued, then the oldest round still
// loading (i - kStages + 1) is waited for and summed, so kStages rounds are in
// flight while one is added; the queue's last rounds are summed at the bag's
// end. A slot past the bag's end copies nothing and is not added. `cell`: this
// thread's cell of stage 0, slot 0. The bag's first chunk of ids (`next_row`,
// `next_w`) is loaded by the caller.
template <typename w_t, typename row_t, bool kWeighted>
__device__ __forceinline__ float4 pool_bag(const uint8_t* table, int row_bytes, int col_off, const row_t* bag_ids,
                                           const float* bag_w, int n, int G, int g_lane, unsigned gmask,
                                           row_t local_rows, row_t next_row, float next_w, bool& bad,
                                           uint32_t cell) {
  constexpr int kQueue = kStages - 1;  // rounds loading behind the newest one
  constexpr uint32_t kStageStride = kRowsInFlight * kThreads * 16;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float w_q[kQueue][kRowsInFlight];  // the queued rounds, oldest first: slot weights
  int cnt_q[kQueue];  // and live slots
  int queued = 0, round = 0;
  for (int j0 = 0; j0 < n; j0 += G) {
    const int cnt = min(G, n - j0);
    row_t my_row;
    float my_w;
    check_row<row_t, kWeighted>(next_row, next_w, cnt, g_lane, local_rows, my_row, my_w, bad);
    if (j0 + G < n) {
      load_ids<row_t, kWeighted>(bag_ids + j0 + G, kWeighted ? bag_w + j0 + G : nullptr, n - j0 - G, g_lane,
                                 next_row, next_w);
    }
    for (int u0 = 0; u0 < cnt; u0 += kRowsInFlight) {
      const uint32_t stage = cell + (round % kStages) * kStageStride;
      float w_new[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const row_t r = __shfl_sync(gmask, my_row, (u0 + u) & (G - 1), G);
        w_new[u] = __shfl_sync(gmask, my_w, (u0 + u) & (G - 1), G);
        if (u0 + u < cnt) copy_async<w_t>(stage + u * kThreads * 16, table + static_cast<int64_t>(r) * row_bytes + col_off);
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
      if (queued == kQueue) {  // the oldest round must land (and be summed) before its cells are reused
        asm volatile("cp.async.wait_group %0;" ::"n"(kQueue) : "memory");
        sum_round<w_t>(acc, cell + ((round - kQueue) % kStages) * kStageStride, w_q[0], cnt_q[0]);
#pragma unroll
        for (int q = 0; q + 1 < kQueue; ++q) {
          cnt_q[q] = cnt_q[q + 1];
#pragma unroll
          for (int u = 0; u < kRowsInFlight; ++u) w_q[q][u] = w_q[q + 1][u];
        }
        --queued;
      }
#pragma unroll
      for (int q = 0; q < kQueue; ++q) {  // append (compile-time indices: the queue stays in registers)
        if (q == queued) {
          cnt_q[q] = cnt - u0;
#pragma unroll
          for (int u = 0; u < kRowsInFlight; ++u) w_q[q][u] = w_new[u];
        }
      }
      ++queued;
      ++round;
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#pragma unroll
  for (int q = 0; q < kQueue; ++q) {
    if (q < queued) sum_round<w_t>(acc, cell + ((round - queued + q) % kStages) * kStageStride, w_q[q], cnt_q[q]);
  }
  return acc;
}

// What thread 0 found of source `src`'s index block for this step: the step's
// epoch, and the block's batch and nnz once its signal arrived and its header
// checked out (ok), else nothing is read from it. A source whose signal arrived
// is checked for a batch mismatch even when a peer has aborted the step: both
// ranks of a mismatch abort each other, and each must report the mismatch
// (record_error ranks it above the abort). A source that is not ok is aborted.
struct SourceIndex {
  int64_t epoch, nnz, batch;
  int ok;
};

__device__ __forceinline__ SourceIndex accept_source(const StepParams& p, int src) {
  SourceIndex s;
  s.epoch = p.state[kCtrLookup] + 1;
  const int64_t* header =
      reinterpret_cast<const int64_t*>(p.buf + index_block(p, s.epoch % p.num_slots, src));
  const int64_t* signal = my_signal(p, kIndexSignals, src);
  s.ok = wait_epoch(p, signal, s.epoch, s.epoch, 1, src);
  const bool arrived = ld_acquire_sys(signal) >= s.epoch;
  const bool gave_up = arrived && __ldcg(header + 3) != 0;
  if (gave_up) {
    // header[3]: the source gave up on the step. Its abort came first, but the
    // one abort word may since hold a later step's: the header alone says so.
    record_error(p, s.epoch, ErrorCode::kPeerAbort, src);
    s.ok = 0;
  } else if (arrived) {
    const int64_t h_epoch = __ldcg(header), h_batch = __ldcg(header + 1), h_nnz = __ldcg(header + 2);
    if (!p.variable_batch && h_batch != p.batch) {
      record_error(p, s.epoch, ErrorCode::kBatchMismatch, src, h_batch, p.batch);
      s.ok = 0;
    } else if (h_epoch != s.epoch || h_nnz < 0 || h_nnz > p.capacity || h_batch < 0 || h_batch > p.max_batch) {
      record_error(p, s.epoch, ErrorCode::kCorrupt, src, 0);
      s.ok = 0;
    }
  }
  // A source that is not ok is aborted, unless it gave up itself (an abort back
  // could overwrite its word's later step).
  if (!s.ok && !gave_up) abort_peer(p, src, s.epoch);
  s.nnz = s.ok ? __ldcg(header + 2) : 0;  // the values checked above
  s.batch = s.ok ? __ldcg(header + 1) : 0;  // == p.batch unless variable_batch
  return s;
}

// A group's bags, in pooling order, three deep: while the current bag's rows
// load, the next bag's first chunk of ids (a DRAM read: ids are written per
// step) and the span of the one after (offsets/lengths: small, L2) are in
// flight, so a bag starts with its ids in registers instead of two dependent
// latencies. The sequence is units of kClaimBags consecutive bags claimed from
// the source's counter (increasing, so the first bag >= bag_end ends it): a
// group that drew short bags takes more of them, and none holds up the end. The
// claim of the next unit is issued when a unit starts, its atomic in flight
// while the unit's bags pool; the lookup's last CTA resets the counters. A span
// is checked when it is used (span_ok); a bad one reads nothing.
template <typename row_t, bool kWeighted>
struct BagQueue {
  const int64_t* offsets;
  const int32_t* lengths;
  const row_t* ids;
  const float* weights;
  unsigned long long* claims;
  int first_bag, bag_end, nnz, G, g_lane;
  unsigned gmask;
  int seq_bag = 0, seq_pos = kClaimBags - 1, pending = 0;
  // The current bag (span, first chunk), the next one (span, first chunk), the one after (span).
  int bag, bag_1, bag_2;
  int64_t begin, begin_1, begin_2;
  int n, n_1, n_2;
  row_t row_0, row_1;
  float w_0, w_1;

  __device__ __forceinline__ int next_bag() {
    if (++seq_pos == kClaimBags) {
      seq_pos = 0;
      seq_bag = first_bag + __shfl_sync(gmask, pending, 0, G) * kClaimBags;
      if (g_lane == 0) pending = static_cast<int>(atomicAdd(claims, 1ull));
      return seq_bag;
    }
    return ++seq_bag;
  }
  __device__ __forceinline__ void span_of(int b, int64_t& b_begin, int& b_n) const {
    b_begin = 0;
    b_n = 0;
    if (b < bag_end) {
      b_begin = __ldcg(offsets + b);
      b_n = __ldcg(lengths + b);
    }
  }
  __device__ __forceinline__ bool span_ok(int64_t b_begin, int b_n) const {
    return b_begin >= 0 && b_begin <= nnz && b_n >= 0 && b_n <= nnz - b_begin;
  }
  __device__ __forceinline__ void first_chunk(int b, int64_t b_begin, int b_n, row_t& row, float& w) const {
    const bool live = b < bag_end && span_ok(b_begin, b_n);
    load_ids<row_t, kWeighted>(ids + (live ? b_begin : 0), kWeighted ? weights + (live ? b_begin : 0) : nullptr,
                               live ? b_n : 0, g_lane, row, w);
  }
  __device__ __forceinline__ void start() {
    if (g_lane == 0) pending = static_cast<int>(atomicAdd(claims, 1ull));
    bag = next_bag();
    bag_1 = next_bag();
    span_of(bag, begin, n);
    span_of(bag_1, begin_1, n_1);
    first_chunk(bag, begin, n, row_0, w_0);
  }
  __device__ __forceinline__ bool done() const { return bag >= bag_end; }
  // Issue the loads that run under the current bag's pool.
  __device__ __forceinline__ void prefetch() {
    first_chunk(bag_1, begin_1, n_1, row_1, w_1);
    bag_2 = next_bag();
    span_of(bag_2, begin_2, n_2);
  }
  __device__ __forceinline__ void advance() {
    bag = bag_1;
    bag_1 = bag_2;
    begin = begin_1;
    n = n_1;
    row_0 = row_1;
    w_0 = w_1;
    begin_1 = begin_2;
    n_1 = n_2;
  }
};

// Pools the queue's current bag (this lane's 4 columns of each 4 * G-column
// block of the row) and stores the vector at row b, the feature's columns, of
// the requester's output block `out`. Table-wise MEAN divides here with the
// TBE's arithmetic: sum * (1.f / L), 1 for an empty bag.
template <typename row_t, bool kWeighted>
__device__ __forceinline__ void pool_to_output(const StepParams& p, BagQueue<row_t, kWeighted>& q, int batch,
                                               uint8_t* out, int out_kind, uint32_t cell, bool& bad) {
  const int f = q.bag / batch;
  const FeatureDesc& feat = p.features[f];
  const row_t* bag_ids = q.ids + q.begin;
  const float* bag_w = kWeighted ? q.weights + q.begin : nullptr;
  const uint8_t* table = reinterpret_cast<const uint8_t*>(feat.weights);
  const bool f32 = feat.weight_dtype == WeightDtype::kF32;
  const row_t local_rows = static_cast<row_t>(feat.local_rows);
  const int dim = static_cast<int>(feat.dim);
  const int row_bytes = dim * (f32 ? 4 : 2);
  const int G = q.G, g_lane = q.g_lane;
  for (int col0 = 0; col0 < dim; col0 += 4 * G) {  // once unless dim > 4 * 32
    if (col0 > 0) load_ids<row_t, kWeighted>(bag_ids, bag_w, q.n, g_lane, q.row_0, q.w_0);
    const int col = col0 + 4 * g_lane;
    const bool col_ok = col < dim;
    const int col_off = (col_ok ? col : 0) * (f32 ? 4 : 2);  // idle lanes read column 0
    float4 v = f32 ? pool_bag<float, row_t, kWeighted>(table, row_bytes, col_off, bag_ids, bag_w, q.n, G, g_lane,
                                                      q.gmask, local_rows, q.row_0, q.w_0, bad, cell)
                   : pool_bag<__half, row_t, kWeighted>(table, row_bytes, col_off, bag_ids, bag_w, q.n, G, g_lane,
                                                       q.gmask, local_rows, q.row_0, q.w_0, bad, cell);
    if (feat.pooling == PoolingMode::kMeanByOwner) {
      const float inv_l = q.n != 0 ? 1.f / static_cast<float>(q.n) : 1.f;
      v = make_float4(v.x * inv_l, v.y * inv_l, v.z * inv_l, v.w * inv_l);
    }
    const int b = q.bag - f * batch;
    if (col_ok) store_out(out, static_cast<int64_t>(b) * p.dim_sum + feat.out_col + col, out_kind, v);
  }
}

// The CTA's share of source `src`'s bags ([f][b] order, the source's batch):
// each group of G lanes pools the bags its queue draws. A bad span or row is
// reported once per lane, before this CTA counts as done (so before the signal).
template <typename row_t, bool kWeighted, bool kTrace>
__device__ __forceinline__ void pool_source(const StepParams& p, int k, int src, const SourceIndex& s,
                                            int group_lanes, int out_kind, uint8_t* stage) {
  const uint8_t* block = p.buf + index_block(p, s.epoch % p.num_slots, src);
  BagQueue<row_t, kWeighted> q;
  q.offsets = reinterpret_cast<const int64_t*>(block + p.offsets_off);
  q.lengths = reinterpret_cast<const int32_t*>(block + p.lengths_off);
  q.ids = reinterpret_cast<const row_t*>(block + p.ids_off);
  q.weights = kWeighted ? reinterpret_cast<const float*>(block + p.weights_off) : nullptr;
  q.claims = reinterpret_cast<unsigned long long*>(p.state + kBagClaims + k);
  // 32-bit bag and id positions (make_step_params checks F * Bmax, C <= 2^30).
  const int batch = static_cast<int>(s.batch);
  q.first_bag = p.lookup_f_lo * batch;
  q.bag_end = p.lookup_f_hi * batch;
  q.nnz = static_cast<int>(s.nnz);
  q.G = group_lanes;
  q.g_lane = threadIdx.x % group_lanes;
  // The group's lanes within the warp (shuffles stay inside the group).
  q.gmask = group_lanes == 32 ? 0xffffffffu : ((1u << group_lanes) - 1u) << (threadIdx.x % 32 / group_lanes * group_lanes);
  uint8_t* out = reinterpret_cast<uint8_t*>(p.peer_bufs[src]) + output_block(p, s.epoch % p.num_slots, p.rank);
  const uint32_t cell = static_cast<uint32_t>(__cvta_generic_to_shared(stage)) + threadIdx.x * 16;
  bool bad = false, bad_span = false;
  for (q.start(); !q.done(); q.advance()) {
    q.prefetch();
    if (!q.span_ok(q.begin, q.n)) {
      bad_span = true;  // this bag's output is not written
      continue;
    }
    pool_to_output(p, q, batch, out, out_kind, cell, bad);
    if constexpr (kTrace) {
      if (src != p.rank && q.g_lane == 0) {
        const int element_bytes = out_kind == static_cast<int>(StepFloat::kFloat) ? 4 : 2;
        trace_remote_bytes(p.state, p.features[q.bag / batch].dim * element_bytes);
      }
    }
  }
  if (bad_span || bad) corrupt_source(p.state, p.peer_pads, p.rank, p.num_slots, src, bad_span ? 1 : 2, s.epoch);
}

// Thread 0, after the CTA's bags: the last CTA of the source signals the
// requester, and, for a step no backward follows (`release`), also releases its
// blocks; the last CTA of the grid resets the claims and releases the epoch the
// combine acquires (and with it every CTA's error record and stores).
__device__ __forceinline__ void finish_source(const StepParams& p, int k, int src, int64_t epoch, int release) {
  if (last_to_arrive(p.state + kDoneSrc + k, gridDim.x)) {
    st_release_sys(peer_signal(p, src, kOutputSignals), epoch);
    if (release) st_release_sys(peer_signal(p, src, kReleaseSignals), epoch);
  }
  if (last_to_arrive(p.state + kDoneLookup, static_cast<int64_t>(gridDim.x) * gridDim.y)) {
    for (int s = 0; s < static_cast<int>(gridDim.y); ++s) p.state[kBagClaims + s] = 0;  // every claim is made
    st_release_sys(p.state + kCtrLookup, epoch);
  }
}

// Specialized on the id width and on weighting (the unweighted kernel carries no
// weight registers); registers decide how many warps hide the gather's latency.
// kTrace: the comm-timeline build (profiling); the default build has none of its code.
template <typename row_t, bool kWeighted, bool kTrace>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    pooled_lookup_kernel(StepParams p, int group_lanes, int out_kind, int release) {
  __shared__ SourceIndex s_source;
  extern __shared__ __align__(16) uint8_t s_stage[];  // [kStages][kRowsInFlight][kThreads] 16-byte cells
  const int k = blockIdx.y;
  const int src = (p.rank + 1 + k) % p.world;
  if (threadIdx.x == 0) s_source = accept_source(p, src);
  __syncthreads();
  const SourceIndex source = s_source;
  if (source.ok) pool_source<row_t, kWeighted, kTrace>(p, k, src, source, group_lanes, out_kind, s_stage);
  __syncthreads();
  if (threadIdx.x == 0) finish_source(p, k, src, source.epoch, release);
}

template <typename row_t, bool kWeighted, bool kTrace>
void launch_lookup(const StepParams& p, int group_lanes, int out_kind, bool after_exit, int release,
                   cudaStream_t stream) {
  // One wave: W sources share the resident CTAs. The stages' shared-memory limit
  // is a per-device attribute: set (and the occupancy computed) again when this
  // process launches on another device.
  static int resident_device = -1, resident = 0;
  int device = 0;
  PGAS_CUDA_CHECK(cudaGetDevice(&device));
  if (device != resident_device) {
    PGAS_CUDA_CHECK(cudaFuncSetAttribute(pooled_lookup_kernel<row_t, kWeighted, kTrace>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kStageBytes));
    resident = resident_ctas(pooled_lookup_kernel<row_t, kWeighted, kTrace>, kThreads, kStageBytes);
    resident_device = device;
  }
  const int64_t bags = std::max<int64_t>(1, (p.lookup_f_hi - p.lookup_f_lo) * p.batch);
  const int64_t groups_per_cta = kThreads / group_lanes;
  const int64_t ctas = std::max<int64_t>(
      1, std::min<int64_t>((bags + groups_per_cta - 1) / groups_per_cta, resident / p.world));
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(p.world));
  // Every source's ids arrive through its signal, the local one's too, so the
  // lookup may start while the index dist's NVLink stores still drain. Its own
  // counters must be settled: `after_exit` only when the host saw a plain
  // launch (an index dist) since the previous step's combine on this stream.
  launch_after_exit(after_exit, pooled_lookup_kernel<row_t, kWeighted, kTrace>, grid, dim3(kThreads), kStageBytes, stream, p,
                    group_lanes, out_kind, release);
}

template <typename row_t, bool kWeighted>
void launch_lookup(const StepParams& p, int group_lanes, int out_kind, bool after_exit, int release,
                   cudaStream_t stream) {
  p.trace ? launch_lookup<row_t, kWeighted, true>(p, group_lanes, out_kind, after_exit, release, stream)
          : launch_lookup<row_t, kWeighted, false>(p, group_lanes, out_kind, after_exit, release, stream);
}

}  // namespace

void launch_pooled_lookup(const StepParams& p, int group_lanes, StepFloat out_type, bool after_exit, bool release,
                          cudaStream_t stream) {
  const int out_kind = static_cast<int>(out_type), r = release ? 1 : 0;
  if (p.id_bytes == 4) {
    p.weighted ? launch_lookup<int32_t, true>(p, group_lanes, out_kind, after_exit, r, stream)
               : launch_lookup<int32_t, false>(p, group_lanes, out_kind, after_exit, r, stream);
  } else {
    p.weighted ? launch_lookup<int64_t, true>(p, group_lanes, out_kind, after_exit, r, stream)
               : launch_lookup<int64_t, false>(p, group_lanes, out_kind, after_exit, r, stream);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
