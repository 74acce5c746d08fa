// The owner backward's update: one step of FBGEMM's exact optimizers (EXACT_SGD,
// EXACT_ROWWISE_ADAGRAD, ADAM) applied by an owner to the rows of its TBE that
// its sources' gradients touch, in the TBE's own weight and optimizer-state
// storage. One algorithm in two phases, written once (walk_chunk, finish_run):
// owner_update.cu runs them with a warp per chunk of sorted ids,
// owner_update_host.cpp with a CPU thread per chunk (the CPU path, the same
// code); torchrec_pgas/sharding/owner_backward.py is its torch-ops reference.
//
// Inputs, n kept ids of one TBE (the owner's rebuild of the ids stock hands
// its TBE, ReceivedBlocks.kept_ids: feature-major, then source, then sample), in
// the order of their sorted row keys (a stable sort: a row's ids in arrival
// order):
//   keys[n]   the ids' row keys, sorted, int32 or int64: table t's row r is
//             key_base[t] + r, key_base the running sum of the tables' rows
//   bags[n]   each sorted id's bag, feature * batch + sample (int32; the
//             gradient's row is the sample, its columns the feature's)
//   offsets   the kept ids' bag offsets [F * batch + 1] (a MEAN bag's length)
//   psw[n]    each sorted id's per-sample weight, or none
//   grad      the pooled gradient, [batch][>= grad_col + dim] per feature
// A row's ids form one run of equal keys. The walk streams through the sorted
// positions: the ids' fields are read as coalesced segments, each id's
// gradient row is read straight from the pooled gradient (no per-id gradient
// rows in memory) and added to its run's sum, and a run's row is updated once
// the next run starts. Each id's term is as FBGEMM's GPU backward forms it (a
// MEAN bag's gradient times 1/length rounded to the gradient's dtype;
// weighted: times the id's weight), and the terms are summed in sorted order
// in fp32 with Kahan compensation: a plain running sum drifts by about
// n * eps / 4 over a hot row's n ids (1-3e-5 at 3000), FBGEMM's GPU kernel
// splits long runs over warps, and the compensated sum stays within an ulp or
// two of the exact one at any length. The sums are deterministic: a device
// sums a row alike in every run, eager and replayed (the products are rounded
// before the sum, never contracted into it). Devices may differ in the last
// bits: a run that crosses a chunk boundary is summed in compensated pieces,
// and the chunks follow the walkers (below), and row-wise Adagrad's sum of the
// row's squares adds in another order on a GPU (each lane's columns, then
// across the lanes) than on the CPU.
// Then one update of that row and its optimizer state in fp32, stored in the
// weights' dtype (round to nearest). No two walkers write one row and nothing
// is atomic (so the keys must be sorted: unsorted ones would split a row into
// runs that two walkers update at once).
//
// Chunks and the two phases. The positions [0, used) are cut into chunks of
// chunk_positions(used, walkers) positions: a size that depends on the used
// positions and the device (its resident walkers) only, never on a launch's
// grid, so an eager step and a replay of it cut alike and sum alike, bit for
// bit. Phase 1 (walk_chunk): a chunk's walker sums and applies every run that
// starts in the chunk and ends in it; the positions before its first run start
// (its head: the tail of an earlier chunk's run) are summed into the chunk's
// head partial; a chunk where no run starts (interior to one long run) is summed
// whole; the sum of the run that starts in a chunk and crosses its end, and an
// interior chunk's sum, are stored as the chunk's run partial (each column's
// compensated sum and its carry). Phase 2 (finish_run, after every walker of
// phase 1): the walker of the chunk a crossing run starts in adds the run
// partials of its interior chunks in chunk order, then the head partial of the
// chunk it ends in, and applies the row: no id is summed in phase 2, whose
// walkers are the few chunks a crossing run starts in. A hot row's n ids cost
// its walkers n / chunks each plus one partial a chunk in phase 2: the split
// FBGEMM makes over CTAs for runs past 1,024 ids, in a fixed order instead of
// fp32 atomics. Partials: two slots a chunk (its run partial, then its head
// partial) of `partial_stride` floats, the column sums at [0, cols), their
// carries at [cols, 2 cols) (cols = (partial_stride - 1) / 2, indexed by
// column), then whether an id added a term (1 or 0).
//
// Bounds: the host checks every table view and feature descriptor against the
// tensors they name (owner_update_host.cpp). On the device a key outside
// every table's rows, a bag outside [0, F * batch) or an id of a feature of
// another table than its key's is skipped: the keys decide the rows written,
// the bags the gradient read. A row whose ids were all skipped is not updated
// (Adam's moments and weight decay would change it with a zero gradient).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>

#include "pgas_check.h"
#include "step_abi.h"

#if defined(__CUDACC__)
#define PGAS_UPDATE_FN __device__ __forceinline__
#define PGAS_UNROLL _Pragma("unroll")
#else
#define PGAS_UPDATE_FN inline
#define PGAS_UNROLL
#endif

namespace torchrec_pgas {

// Largest table dim the update takes (a GPU lane holds up to dim / 32 sums).
constexpr int kOwnerMaxDim = 512;
// The largest chunk of sorted positions (one walker's serial share of a phase); the smallest is 32.
constexpr int64_t kOwnerChunk = 256;

// A table's views in the TBE's storage, built by the host from the op's
// tensors (never from addresses Python passed).
struct OwnerTable {
  void* weights;  // [rows][dim], the update's weight dtype
  float* momentum1;  // row-wise Adagrad [rows], Adam [rows][dim]; SGD: null
  float* momentum2;  // Adam [rows][dim]; else null
  int64_t key_base;
  int64_t rows;
  int64_t dim;
};

struct OwnerUpdateParams {
  const int32_t* keys32;  // the sorted keys: one of the two is set
  const int64_t* keys64;
  const int32_t* bags;
  const int64_t* offsets;
  const float* psw;  // null: unweighted
  const void* grad;  // the gradient's dtype: the kernels' grad_t
  int64_t grad_row_stride;
  const OwnerFeatureDesc* features;
  const OwnerTable* tables;
  const OwnerHyper* hyper;
  OwnerUpdateConfig config;
  int64_t n;
  int64_t num_features;
  int64_t num_tables;
  const int64_t* apply;  // null, or a word on the update's device: 0 applies nothing (a refused step)
  const int64_t* used;  // null, or a word on the update's device: positions at or past it hold only keys past
                        // every table (a captured step's capacity); it sizes the walkers' chunks
  int64_t walkers;  // the walkers the chunks are sized for: the GPU kernel's resident warps; 1 on the CPU
  float* partials;  // [max_chunks(n, walkers)][2][partial_stride]: the chunks' partial sums (phase 1 -> phase 2)
  int64_t partial_stride;
};

// The positions that may hold ids: n, or fewer where the device word `used` says so.
PGAS_UPDATE_FN int64_t used_positions(const OwnerUpdateParams& p) {
  if (p.used == nullptr) return p.n;
  const int64_t used = *p.used;
  return used < 0 ? 0 : used < p.n ? used : p.n;
}

// The positions a chunk holds for `walkers` walkers: a multiple of 32 in [32, kOwnerChunk], enough for every
// walker to hold about one chunk (a small step's walk is a few dependent loads per id: in 256-position chunks
// it would run on used / 256 walkers). At most max_chunks(n, walkers) chunks cover the used positions.
PGAS_UPDATE_FN int64_t chunk_positions(int64_t used, int64_t walkers) {
  const int64_t per_walker = (used + walkers - 1) / walkers;
  const int64_t batches = (per_walker + 31) / 32;
  return batches < 1 ? 32 : batches * 32 < kOwnerChunk ? batches * 32 : kOwnerChunk;
}

inline int64_t max_chunks(int64_t n, int64_t walkers) {
  const int64_t at_largest = (n + kOwnerChunk - 1) / kOwnerChunk;
  return at_largest > walkers ? at_largest : walkers;
}

PGAS_UPDATE_FN int64_t key_at(const OwnerUpdateParams& p, int64_t q) {
  return p.keys32 != nullptr ? static_cast<int64_t>(p.keys32[q]) : p.keys64[q];
}

// The table whose key range holds `key` (the last with key_base <= key).
PGAS_UPDATE_FN int64_t table_of(const OwnerUpdateParams& p, int64_t key) {
  int64_t lo = 0, hi = p.num_tables;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.tables[mid].key_base <= key) lo = mid; else hi = mid;
  }
  return lo;
}

// The optimizers' arithmetic per column, as FBGEMM's GPU templates take it;
// the fused multiply-adds are written out so that every device rounds alike.
PGAS_UPDATE_FN float adagrad_decayed(float g, float w, const OwnerHyper& h, WeightDecay mode) {
  return mode == WeightDecay::kL2 ? fmaf(h.weight_decay, w, g) : g;
}

struct RowStep {  // w <- correction * w - multiplier * g
  float multiplier;
  float correction;
};

PGAS_UPDATE_FN RowStep adagrad_row_step(float momentum, const OwnerHyper& h, WeightDecay mode) {
  const float multiplier = h.lr / (sqrtf(momentum) + h.eps);
  const float correction = mode == WeightDecay::kL2        ? fmaf(-multiplier, h.weight_decay, 1.f)
                           : mode == WeightDecay::kDecouple ? fmaf(-h.lr, h.weight_decay, 1.f)
                                                            : 1.f;
  return {multiplier, correction};
}

struct AdamColumn {
  float w, m1, m2;
};

PGAS_UPDATE_FN AdamColumn adam_column(float w, float g, float m1, float m2, const OwnerHyper& h) {
  m1 = fmaf(h.beta1, m1, (1.f - h.beta1) * g);
  m2 = fmaf(h.beta2, m2, (1.f - h.beta2) * g * g);
  const float step = (m1 / h.bias_correction1) / (sqrtf(m2 / h.bias_correction2) + h.eps);
  return {fmaf(-h.lr, step, w), m1, m2};
}

// Lanes (a warp, or one CPU thread) play two parts in the walk below. Over a
// row, lane l holds columns l, l + kCount, ... in arrays of kMaxColumns
// (columns(dim) of them in use); over the sorted positions, a batch of kCount
// positions is read lane-per-position and staged (stage: each lane's IdMeta
// into the walker's slots, a warp's in shared memory), then the lanes read each
// position's fields from its slot (staged: broadcast reads of 8 or 16 bytes
// where a shuffle moves 4, and no lane holds its position's fields while the
// batch is walked). sum adds a value over the lanes, ballot gathers a flag per lane
// (lane i: bit i), sync orders the lanes' reads of a row's state before a
// write. kDepth: the ids whose gradient rows are loaded before the first of
// them is summed.

// What the walk needs of sorted position q, read lane-per-position: its row
// (table -1: a key outside every table's rows, whose run is skipped), whether it
// starts its row's run, and its term's source: where its gradient row starts
// (-1: the id adds nothing: a bad bag, or a feature of another table than its
// key's), its per-sample weight and its MEAN factor. 32 bytes, the term's
// fields first, aligned for wide shared-memory reads of a staged slot.
struct alignas(16) IdMeta {
  int64_t src;
  float weight;
  float inv_length;
  int32_t row;  // < 2^31: checked on the host
  int32_t table;
  int32_t dim;
  bool starts;
  bool beyond;  // its key is past every table's rows, as are all after it (sorted): nothing left to update
};

PGAS_UPDATE_FN IdMeta id_meta(const OwnerUpdateParams& p, int64_t q) {
  const int64_t key = key_at(p, q);
  IdMeta m{-1, 0.f, 0.f, 0, -1, 0, q == 0 || key_at(p, q - 1) != key, false};
  const int64_t t = table_of(p, key);
  const int64_t row = key - p.tables[t].key_base;
  m.beyond = t == p.num_tables - 1 && row >= p.tables[t].rows;
  if (row < 0 || row >= p.tables[t].rows) return m;
  m.table = static_cast<int32_t>(t);
  m.row = static_cast<int32_t>(row);
  m.dim = static_cast<int32_t>(p.tables[t].dim);
  const int64_t bag = p.bags[q];
  if (bag < 0 || bag >= p.num_features * p.config.batch) return m;
  const int64_t f = bag / p.config.batch;
  if (p.features[f].table != t) return m;
  const int64_t length = p.config.mean ? p.offsets[bag + 1] - p.offsets[bag] : 1;
  m.src = (bag - f * p.config.batch) * p.grad_row_stride + p.features[f].grad_col;
  m.weight = p.config.weighted ? p.psw[q] : 1.f;
  m.inv_length = length > 1 ? static_cast<float>(1.0 / static_cast<double>(length)) : 1.f;
  return m;
}

// Asks L2 for the `bytes` from `row` (the 128-byte lines that hold them); nothing on the CPU. A hint: it reads
// no value and holds no register, and the walk gives it only rows it has bounds-checked.
PGAS_UPDATE_FN void prefetch_l2(const void* row, int64_t bytes) {
#if defined(__CUDA_ARCH__)
  const uintptr_t first = reinterpret_cast<uintptr_t>(row) & ~uintptr_t{127};
  const uintptr_t end = reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = first; line < end; line += 128) asm volatile("prefetch.L2 [%0];" ::"l"(line));
#else
  (void)row;
  (void)bytes;
#endif
}

// The gradient row one position of a batch will be read for, asked of L2 as the batch starts: the walk then
// loads rows kDepth ids at a time, so without it a walker has only those kDepth rows in flight from DRAM.
template <typename grad_t>
PGAS_UPDATE_FN void prefetch_grad_row(const OwnerUpdateParams& p, const IdMeta& m) {
  if (m.src >= 0) prefetch_l2(static_cast<const grad_t*>(p.grad) + m.src, m.dim * int64_t{sizeof(grad_t)});
}

// The state a run's update reads and writes (its weight row and optimizer state), asked of L2 as the batch
// that opens the run starts (or as phase 2 starts a crossing run's partials): the walk loads it as the run
// opens, right after the run before it is applied, and would wait on DRAM there. `table` -1 asks nothing.
template <typename weight_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void prefetch_state(const OwnerUpdateParams& p, int32_t table, int64_t row) {
  if (table < 0) return;
  const OwnerTable& t = p.tables[table];
  const int64_t dim = t.dim;
  prefetch_l2(static_cast<const weight_t*>(t.weights) + row * dim, dim * int64_t{sizeof(weight_t)});
  if (kOptimizer == Optimizer::kRowwiseAdagrad) prefetch_l2(t.momentum1 + row, sizeof(float));
  if (kOptimizer == Optimizer::kAdam) {
    prefetch_l2(t.momentum1 + row * dim, dim * int64_t{sizeof(float)});
    prefetch_l2(t.momentum2 + row * dim, dim * int64_t{sizeof(float)});
  }
}

// a * b rounded to fp32 on its own: never contracted into a following add.
PGAS_UPDATE_FN float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// sum += term, Kahan-compensated: carry holds what the rounded sum lost.
PGAS_UPDATE_FN void add_compensated(float& sum, float& carry, float term) {
  const float y = term - carry;
  const float t = sum + y;
  carry = (t - sum) - y;
  sum = t;
}

// A row's weights (the lane's columns) and row-wise momentum as they were
// before the update: loaded as the run opens, once the run before it is applied
// (phase 2: after a crossing run's partials are added).
template <int kMaxColumns>
struct RowBefore {
  float w[kMaxColumns];
  float momentum;  // row-wise Adagrad's; else 0
};

// The run being summed: its row, its summed gradient so far and its row's state.
template <int kMaxColumns>
struct OpenRun {
  int32_t table;  // -1: none open, or a key outside the tables (nothing to update)
  bool added;  // an id of the run added its term: a run of skipped ids only (corrupt) changes nothing
  int64_t row;
  float g[kMaxColumns];
  float carry[kMaxColumns];
  RowBefore<kMaxColumns> before;
};

// One optimizer step of `row` of `table` with its summed gradient g.
template <typename Lanes, typename weight_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void update_row(const OwnerTable& table, int64_t row, const OwnerHyper& h,
                               const OwnerUpdateConfig& config, Lanes lanes, const float* g,
                               const RowBefore<Lanes::kMaxColumns>& before) {
  const int dim = static_cast<int>(table.dim);
  weight_t* w = static_cast<weight_t*>(table.weights) + row * dim;
  RowStep step{h.lr, 1.f};  // SGD
  if (kOptimizer == Optimizer::kRowwiseAdagrad) {
    float squares = 0.f;
    PGAS_UNROLL
    for (int j = 0; j < lanes.columns(dim); ++j) {
      const int d = lanes.lane + j * Lanes::kCount;
      const float gd = d < dim ? adagrad_decayed(g[j], before.w[j], h, config.weight_decay_mode) : 0.f;
      squares = fmaf(gd, gd, squares);
    }
    const float m = before.momentum + lanes.sum(squares) / static_cast<float>(dim);
    lanes.sync();  // every lane has read the old momentum
    if (lanes.lane == 0) table.momentum1[row] = m;
    step = adagrad_row_step(m, h, config.weight_decay_mode);
  }
  float* m1 = kOptimizer == Optimizer::kAdam ? table.momentum1 + row * dim : nullptr;
  float* m2 = kOptimizer == Optimizer::kAdam ? table.momentum2 + row * dim : nullptr;
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) {
    const int d = lanes.lane + j * Lanes::kCount;
    if (d >= dim) continue;
    if (m1 == nullptr) {
      w[d] = static_cast<weight_t>(fmaf(-step.multiplier, g[j], step.correction * before.w[j]));
      continue;
    }
    const AdamColumn c = adam_column(before.w[j], g[j], m1[d], m2[d], h);
    w[d] = static_cast<weight_t>(c.w);
    m1[d] = c.m1;
    m2[d] = c.m2;
  }
}

// One id's gradient row (the lane's columns), as FBGEMM's GPU backward forms
// its term: a MEAN bag's gradient times 1/length rounded to the gradient's
// dtype, then times the per-sample weight; zeros where the id adds nothing.
template <typename Lanes, typename grad_t>
PGAS_UPDATE_FN void load_term(const OwnerUpdateParams& p, int64_t src, int dim, float weight, float inv_length,
                              Lanes lanes, float* term) {
  const grad_t* grad = static_cast<const grad_t*>(p.grad);
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) {
    const int d = lanes.lane + j * Lanes::kCount;
    float s = src >= 0 && d < dim ? static_cast<float>(grad[src + d]) : 0.f;
    if (p.config.mean) s = static_cast<float>(static_cast<grad_t>(mul_rn(s, inv_length)));
    if (p.config.weighted) s = mul_rn(s, weight);
    term[j] = s;
  }
}

// A run's first id: its row's state before the update (the lane's columns).
template <typename Lanes, typename weight_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void load_before(const OwnerUpdateParams& p, int32_t table, int64_t row, Lanes lanes,
                                RowBefore<Lanes::kMaxColumns>& before) {
  const OwnerTable& t = p.tables[table < 0 ? 0 : table];
  const int dim = table < 0 ? 0 : static_cast<int>(t.dim);
  const weight_t* w = static_cast<const weight_t*>(t.weights) + row * dim;
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) {
    const int d = lanes.lane + j * Lanes::kCount;
    before.w[j] = d < dim ? static_cast<float>(w[d]) : 0.f;
  }
  before.momentum =
      table >= 0 && kOptimizer == Optimizer::kRowwiseAdagrad ? t.momentum1[row] : 0.f;
}

// Applies the open run, if any.
template <typename Lanes, typename weight_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void close_run(const OwnerUpdateParams& p, const OwnerHyper& h, const OpenRun<Lanes::kMaxColumns>& run,
                              Lanes lanes) {
  if (run.table >= 0 && run.added) {
    update_row<Lanes, weight_t, kOptimizer>(p.tables[run.table], run.row, h, p.config, lanes, run.g, run.before);
  }
}

// A chunk's two partials: the sum of the run that crosses its end (or of the whole chunk, where no run starts
// in it), and the sum of its head (the positions before its first run start).
enum class Partial : int { kRun = 0, kHead = 1 };

PGAS_UPDATE_FN float* partial_at(const OwnerUpdateParams& p, int64_t chunk, Partial which) {
  return p.partials + (2 * chunk + static_cast<int>(which)) * p.partial_stride;
}

// The columns a partial holds: the launch's widest table's.
PGAS_UPDATE_FN int partial_columns(const OwnerUpdateParams& p) { return static_cast<int>((p.partial_stride - 1) / 2); }

// A chunk's partial: the column sums and carries as the lane holds them, and whether an id added a term.
template <typename Lanes>
PGAS_UPDATE_FN void store_partial(const OwnerUpdateParams& p, int64_t chunk, Partial which, int dim, const float* g,
                                  const float* carry, bool added, Lanes lanes) {
  float* out = partial_at(p, chunk, which);
  const int64_t cols = partial_columns(p);
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) {
    const int d = lanes.lane + j * Lanes::kCount;
    if (d < dim) {
      out[d] = g[j];
      out[cols + d] = carry[j];
    }
  }
  if (lanes.lane == 0) out[2 * cols] = added ? 1.f : 0.f;
}

// Adds a chunk's partial to a run's compensated sum: its sum, then its carry taken back.
template <typename Lanes>
PGAS_UPDATE_FN void add_partial(const OwnerUpdateParams& p, int64_t chunk, Partial which, int dim, float* g,
                                float* carry, bool& added, Lanes lanes) {
  const float* in = partial_at(p, chunk, which);
  const int64_t cols = partial_columns(p);
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) {
    const int d = lanes.lane + j * Lanes::kCount;
    if (d < dim) {
      add_compensated(g[j], carry[j], in[d]);
      add_compensated(g[j], carry[j], -in[cols + d]);
    }
  }
  added = added || in[2 * cols] != 0.f;
}

// Adds the terms of positions [lo, hi), all of one run (of a table `dim` wide), in sorted order: per batch of
// kCount positions their fields lane-per-position, then kDepth ids' gradient rows in flight at a time.
template <typename Lanes, typename grad_t>
PGAS_UPDATE_FN void sum_terms(const OwnerUpdateParams& p, int64_t lo, int64_t hi, int dim, Lanes lanes, float* g,
                              float* carry, bool& added) {
  constexpr int kDepth = Lanes::kDepth, kColumns = Lanes::kMaxColumns;
  for (int64_t q0 = lo; q0 < hi; q0 += Lanes::kCount) {
    const int64_t q = q0 + lanes.lane;
    const IdMeta mine = q < hi ? id_meta(p, q) : IdMeta{-1, 0.f, 0.f, 0, -1, 0, false, false};
    prefetch_grad_row<grad_t>(p, mine);
    lanes.stage(mine);
    const int count = hi - q0 < Lanes::kCount ? static_cast<int>(hi - q0) : Lanes::kCount;
    for (int i0 = 0; i0 < count; i0 += kDepth) {
      float term[kDepth][kColumns];
      bool adds[kDepth];
      PGAS_UNROLL
      for (int k = 0; k < kDepth; ++k) {  // loads only
        const int i = i0 + k < count ? i0 + k : count - 1;
        const IdMeta id = lanes.staged(i);
        adds[k] = i0 + k < count && id.src >= 0;
        load_term<Lanes, grad_t>(p, adds[k] ? id.src : -1, dim, id.weight, id.inv_length, lanes, term[k]);
      }
      PGAS_UNROLL
      for (int k = 0; k < kDepth; ++k) {
        if (!adds[k]) continue;
        added = true;
        PGAS_UNROLL
        for (int j = 0; j < lanes.columns(dim); ++j) add_compensated(g[j], carry[j], term[k][j]);
      }
    }
  }
}

// Whether `key` lies past every table's rows (a captured step's padding sorts there).
PGAS_UPDATE_FN bool past_tables(const OwnerUpdateParams& p, int64_t key) {
  const OwnerTable& last = p.tables[p.num_tables - 1];
  return key >= last.key_base + last.rows;
}

// Positions [lo, hi) of chunk `chunk`, all of one run that started in an earlier chunk: summed into the chunk's
// partial `which`, which phase 2 adds to the run's (nothing is stored for keys outside every table: phase 2
// finishes no such run). The whole chunk where no run starts in it (its run partial); else its head, the
// positions before its first run start.
template <typename Lanes, typename grad_t>
PGAS_UPDATE_FN void sum_partial(const OwnerUpdateParams& p, int64_t chunk, Partial which, int64_t lo, int64_t hi,
                                Lanes lanes) {
  const int64_t key = key_at(p, lo);
  if (key < 0 || past_tables(p, key)) return;
  const int dim = static_cast<int>(p.tables[table_of(p, key)].dim);
  float g[Lanes::kMaxColumns], carry[Lanes::kMaxColumns];
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) g[j] = carry[j] = 0.f;
  bool added = false;
  sum_terms<Lanes, grad_t>(p, lo, hi, dim, lanes, g, carry, added);
  store_partial(p, chunk, which, dim, g, carry, added, lanes);
}

// The first run start in [lo, hi), hi if none: kCount positions' keys at a time against the key before lo.
template <typename Lanes>
PGAS_UPDATE_FN int64_t first_start(const OwnerUpdateParams& p, int64_t lo, int64_t hi, Lanes lanes) {
  if (lo == 0) return 0;
  const int64_t key = key_at(p, lo - 1);
  for (int64_t q0 = lo; q0 < hi; q0 += Lanes::kCount) {
    const int64_t q = q0 + lanes.lane;
    const unsigned starts = lanes.ballot(q < hi && key_at(p, q) != key);
    if (starts != 0) return q0 + lanes.first(starts);
  }
  return hi;
}

// Phase 1 for chunk `chunk` of sorted positions, [lo, hi) = [chunk * size, min((chunk + 1) * size, used)):
// every run that starts in it, in sorted order, summed over its ids and applied when the next run starts; the
// last one stored as the chunk's run partial instead where it runs on past hi. Positions before the chunk's
// first run start belong to an earlier chunk's run: summed first, as the chunk's head partial, which phase 2
// adds to that run. Then, from the first start, per batch of kCount positions: the fields lane-per-position
// (id_meta); then, kDepth ids at a time, their gradient rows are loaded before the first is summed, so a walker
// keeps kDepth rows in flight; a run's weight row and state are loaded as it opens, once the run before it is
// applied. Every branch is uniform over the lanes (all of them walk the same id), so they stay converged. Keys
// past every table's rows sort last and end every walk.
template <typename Lanes, typename weight_t, typename grad_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void walk_chunk(const OwnerUpdateParams& p, int64_t chunk, int64_t size, int64_t used, Lanes lanes) {
  constexpr int kDepth = Lanes::kDepth, kColumns = Lanes::kMaxColumns;
  const int64_t lo = chunk * size, hi = lo + size < used ? lo + size : used;
  if (lo >= hi) return;
  if (lo > 0 && key_at(p, lo - 1) == key_at(p, hi - 1)) {  // no run starts here
    return sum_partial<Lanes, grad_t>(p, chunk, Partial::kRun, lo, hi, lanes);
  }
  const int64_t start = first_start(p, lo, hi, lanes);
  if (start > lo) sum_partial<Lanes, grad_t>(p, chunk, Partial::kHead, lo, start, lanes);
  const OwnerHyper h = *p.hyper;  // once: the row stores below may alias it for all the compiler knows
  OpenRun<kColumns> run;
  run.table = -1;
  run.added = false;
  run.row = 0;
  for (int64_t q0 = start; q0 < hi; q0 += Lanes::kCount) {
    const int64_t q = q0 + lanes.lane;
    const IdMeta mine = q < hi ? id_meta(p, q) : IdMeta{-1, 0.f, 0.f, 0, -1, 0, false, false};
    prefetch_grad_row<grad_t>(p, mine);
    if (mine.starts) prefetch_state<weight_t, kOptimizer>(p, mine.table, mine.row);
    lanes.stage(mine);
    // The batch ends at hi (batches start at the first run start, so the last may overrun the chunk: a run open
    // there goes on into the next chunk) or at the first key past every table (the padding of a captured step's
    // fixed capacity: never walked; it ends the walk).
    const unsigned past = lanes.ballot(mine.starts && mine.beyond);
    const int in_chunk = hi - q0 < Lanes::kCount ? static_cast<int>(hi - q0) : Lanes::kCount;
    const int end = past != 0 ? lanes.first(past) : in_chunk;
    // The batch's positions that open a run (bit i: position q0 + i); every position before its end lies in a
    // run of this chunk (the walk starts at a run start).
    const unsigned starts = lanes.ballot(mine.starts);
    for (int i0 = 0; i0 < end; i0 += kDepth) {
      float term[kDepth][kColumns];
      int32_t tables[kDepth], dims[kDepth], rows[kDepth];
      bool adds[kDepth], opens[kDepth];
      PGAS_UNROLL
      for (int k = 0; k < kDepth; ++k) {  // loads only: kDepth ids' rows in flight
        const int i = i0 + k < end ? i0 + k : end - 1;
        opens[k] = i0 + k < end && ((starts >> i) & 1u) != 0;
        const IdMeta id = lanes.staged(i);
        tables[k] = id.table;
        dims[k] = id.dim;
        rows[k] = id.row;
        adds[k] = i0 + k < end && id.src >= 0;
        load_term<Lanes, grad_t>(p, adds[k] ? id.src : -1, dims[k], id.weight, id.inv_length, lanes, term[k]);
      }
      PGAS_UNROLL
      for (int k = 0; k < kDepth; ++k) {  // the sums, in sorted order
        if (opens[k]) {
          close_run<Lanes, weight_t, kOptimizer>(p, h, run, lanes);
          run.table = tables[k];
          run.added = false;
          run.row = rows[k];
          // Loaded into the run itself, first used when the run closes.
          load_before<Lanes, weight_t, kOptimizer>(p, tables[k], rows[k], lanes, run.before);
          PGAS_UNROLL
          for (int j = 0; j < lanes.columns(dims[k]); ++j) run.g[j] = run.carry[j] = 0.f;
        }
        if (adds[k]) {
          run.added = true;
          PGAS_UNROLL
          for (int j = 0; j < lanes.columns(dims[k]); ++j) add_compensated(run.g[j], run.carry[j], term[k][j]);
        }
      }
    }
    if (past != 0) return close_run<Lanes, weight_t, kOptimizer>(p, h, run, lanes);  // the padding
  }
  const bool crosses = hi < used && run.table >= 0 && key_at(p, hi) == key_at(p, hi - 1);
  if (crosses) {
    store_partial(p, chunk, Partial::kRun, static_cast<int>(p.tables[run.table].dim), run.g, run.carry, run.added,
                  lanes);
  } else {
    close_run<Lanes, weight_t, kOptimizer>(p, h, run, lanes);
  }
}

// The first position in [lo, hi) whose key is past `key` (hi if none): the keys are sorted.
PGAS_UPDATE_FN int64_t run_end(const OwnerUpdateParams& p, int64_t key, int64_t lo, int64_t hi) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (key_at(p, mid) <= key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Phase 2 for chunk `chunk`: where a run starts in it and crosses its end, the run's sum is its partial, then
// the partials of the chunks it covers whole (in chunk order), then the head partial of the chunk it ends in
// (its tail: that chunk's positions before its first run start); then the row's one update.
template <typename Lanes, typename weight_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void finish_run(const OwnerUpdateParams& p, int64_t chunk, int64_t size, int64_t used, Lanes lanes) {
  const int64_t lo = chunk * size, hi = lo + size;
  if (hi >= used) return;
  const int64_t key = key_at(p, hi - 1);
  if (key_at(p, hi) != key || (lo > 0 && key_at(p, lo - 1) == key)) return;  // ends here, or starts before
  const IdMeta last = id_meta(p, hi - 1);
  if (last.table < 0) return;  // a key outside the tables: nothing was stored
  prefetch_state<weight_t, kOptimizer>(p, last.table, last.row);
  const OwnerTable& table = p.tables[last.table];
  const int dim = static_cast<int>(table.dim);
  OpenRun<Lanes::kMaxColumns> run;
  run.added = false;
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) run.g[j] = run.carry[j] = 0.f;
  add_partial(p, chunk, Partial::kRun, dim, run.g, run.carry, run.added, lanes);
  const int64_t end = run_end(p, key, hi, used);
  const int64_t whole_end = end == used ? (used + size - 1) / size : end / size;  // past the chunks it covers
  for (int64_t c = chunk + 1; c < whole_end; ++c) {
    add_partial(p, c, Partial::kRun, dim, run.g, run.carry, run.added, lanes);
  }
  if (whole_end * size < end) add_partial(p, whole_end, Partial::kHead, dim, run.g, run.carry, run.added, lanes);
  if (!run.added) return;
  load_before<Lanes, weight_t, kOptimizer>(p, last.table, last.row, lanes, run.before);
  update_row<Lanes, weight_t, kOptimizer>(table, last.row, *p.hyper, p.config, lanes, run.g, run.before);
}

// The GPU update (owner_update.cu): both phases on `stream`, for tables up to `max_dim` wide, the phases' chunk
// counters (16 bytes) and the partials in the floats that `alloc_partials(count)` allocates, 8-byte aligned (the
// host's: the stream's caching allocator, a capture's graph pool). Raw pointers only: the kernel file includes no
// tensor header.
void launch_owner_update(OwnerUpdateParams p, c10::ScalarType grad, c10::ScalarType weights, int64_t max_dim,
                         const std::function<float*(int64_t)>& alloc_partials, cudaStream_t stream);

// Calls fn(weight_t{}, grad_t{}, optimizer) for the update's weight and gradient dtypes and its optimizer (an
// std::integral_constant: each optimizer's walk is its own kernel, without the others' branches).
template <typename Fn>
void dispatch_owner_update(c10::ScalarType grad, c10::ScalarType weights, Optimizer optimizer, Fn&& fn) {
  PGAS_CHECK(weights == c10::kFloat || weights == c10::kHalf, "owner_update: weights are %s, not fp32 or fp16",
             c10::toString(weights));
  auto with_optimizer = [&](auto weight, auto grad_type) {
    switch (optimizer) {
      case Optimizer::kSgd: return fn(weight, grad_type, std::integral_constant<Optimizer, Optimizer::kSgd>{});
      case Optimizer::kRowwiseAdagrad:
        return fn(weight, grad_type, std::integral_constant<Optimizer, Optimizer::kRowwiseAdagrad>{});
      case Optimizer::kAdam: return fn(weight, grad_type, std::integral_constant<Optimizer, Optimizer::kAdam>{});
    }
    PGAS_CHECK(false, "owner_update: optimizer %lld unknown", static_cast<long long>(optimizer));
  };
  auto with_grad = [&](auto weight) {
    switch (grad) {
      case c10::kFloat: return with_optimizer(weight, float{});
      case c10::kHalf: return with_optimizer(weight, c10::Half{});
      case c10::kBFloat16: return with_optimizer(weight, c10::BFloat16{});
      default: PGAS_CHECK(false, "owner_update: gradient dtype %s is not fp32, fp16 or bf16", c10::toString(grad));
    }
  };
  if (weights == c10::kHalf) {
    with_grad(c10::Half{});
  } else {
    with_grad(float{});
  }
}

}  // namespace torchrec_pgas
