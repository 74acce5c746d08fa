// The owner backward's update: one step of FBGEMM's exact optimizers (EXACT_SGD,
// EXACT_ROWWISE_ADAGRAD, ADAM) applied by an owner to the rows of its TBE that
// its sources' gradients touch, in the TBE's own weight and optimizer-state
// storage. One algorithm, written once (sum_run, sum_block_head,
// combine_run): owner_update.cu runs it with a group of lanes of a warp per
// run, owner_update_host.cpp with a one-lane group per CPU thread (the CPU
// path, the same code); torchrec_pgas/sharding/owner_backward.py is its
// torch-ops reference.
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
// A row's ids form one run of equal keys. Each id's term is as FBGEMM's GPU
// backward forms it (a MEAN bag's gradient times 1/length rounded to the
// gradient's dtype; weighted: times the id's weight), and a run's terms are
// summed in sorted order in fp32 with Kahan compensation (a plain running sum
// drifts by about n * eps / 4 over a hot row's n ids; the compensated one stays
// within an ulp or two at any length), the products rounded before the sum,
// never contracted into it. Then one update of the row and its optimizer state
// in fp32, stored in the weights' dtype (round to nearest). No two groups write
// one row and nothing is atomic (so the keys must be sorted).
//
// Runs, blocks and the two phases. The used positions [0, used) (n, or a
// device word's count: a captured step's capacity) are listed as runs (the
// run list: each run's first position, then `used`; built on the device from
// the count, owner_update.cu) and cut into blocks of kOwnerBlock positions,
// a fixed size: the cut depends on the positions alone, never on a launch or
// a device, so an eager step and a replay of it sum alike, bit for bit.
//   Phase 1 (sum_run, sum_block_head): a run that lies inside one block is
//   summed and applied by one group. A run that crosses blocks is summed one
//   block's piece at a time, each piece by one group into a partial (each
//   column's compensated sum and its carry): slot 1 of the block it starts in
//   (its first piece), slot 0 of each later block it reaches (that block's
//   head piece). A block has at most one of each: a run that starts in it and
//   leaves it is its only such run, and so is the run that enters it.
//   Phase 2 (combine_run, after every group of phase 1): the group of the block
//   a crossing run starts in adds its partials in block order and applies the
//   row.
// A hot row's n ids cost n / kOwnerBlock groups of phase 1 and n / kOwnerBlock
// partials in phase 2, where FBGEMM splits runs past 1,024 ids over CTAs with
// fp32 atomics; the order here is fixed. Only row-wise Adagrad's sum of the
// row's squares adds in another order on a GPU (each lane's columns, then
// across the group's lanes) than on the CPU.
//
// A group of kLanes lanes holds a row's columns four adjacent ones a lane
// (column_of): a gradient, weight or state row is read in 4-element vectors
// where the host found it aligned (vector loads change no value). An id's
// fields (its gradient row's start, weight, MEAN factor) are read one id a lane
// and broadcast through the group; kDepth ids' gradient rows are loaded before
// the first of them is summed. A run's row state is loaded as its run starts.
//
// Partials: `partial_stride` floats a slot, slot 2 * block + side: the column
// sums at [0, cols), their carries at [cols, 2 cols) (cols = (partial_stride -
// 1) / 2, indexed by column), then whether an id of the piece added a term (1
// or 0).
//
// Bounds: the host checks every table view and feature descriptor against the
// tensors they name (owner_update_host.cpp). On the device a key outside
// every table's rows, a bag outside [0, F * batch) or an id of a feature of
// another table than its key's is skipped: the keys decide the rows written,
// the bags the gradient read, the run list (positions in [0, used]) the
// partial slots. A row whose ids were all skipped is not updated (Adam's
// moments and weight decay would change it with a zero gradient).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "pgas_check.h"
#include "step_abi.h"

#if defined(__CUDACC__)
#define PGAS_UPDATE_FN __device__ __forceinline__
#define PGAS_UPDATE_HD __host__ __device__ __forceinline__
#define PGAS_UNROLL _Pragma("unroll")
#else
#define PGAS_UPDATE_FN inline
#define PGAS_UPDATE_HD inline
#define PGAS_UNROLL
#endif

namespace torchrec_pgas {

// Largest table dim the update takes (a GPU group holds up to 4 * kLanes * kColumns / 4 columns).
constexpr int kOwnerMaxDim = 512;
// The positions of a block: the most ids one group sums in one go, and the cut of crossing runs.
constexpr int64_t kOwnerBlock = 256;

// A table's views in the TBE's storage, built by the host from the op's
// tensors (never from addresses Python passed).
struct OwnerTable {
  void* weights;  // [rows][dim], the update's weight dtype
  float* momentum1;  // row-wise Adagrad [rows], Adam [rows][dim]; SGD: null
  float* momentum2;  // Adam [rows][dim]; else null
  int64_t key_base;
  int64_t rows;
  int64_t dim;
  int64_t vectors;  // 1: dim % 4 == 0 and its weight and state rows start on 4-element boundaries
};

struct OwnerUpdateParams {
  const int32_t* keys32;  // the sorted keys: one of the two is set
  const int64_t* keys64;
  const int32_t* bags;
  const int64_t* offsets;
  const float* psw;  // null: unweighted
  const void* grad;  // the gradient's dtype: the kernels' grad_t
  int64_t grad_row_stride;
  bool grad_vectors;  // every feature's gradient row starts on a 4-element boundary
  const OwnerFeatureDesc* features;
  const OwnerTable* tables;
  const OwnerHyper* hyper;
  OwnerUpdateConfig config;
  int64_t n;
  int64_t num_features;
  int64_t num_tables;
  const int64_t* apply;  // null, or a word on the update's device: 0 applies nothing (a refused step)
  const int64_t* used;  // null, or a word on the update's device: positions at or past it hold no ids the
                        // update reads (a captured step's capacity)
  const int32_t* run_begin;  // [runs + 1]: each run's first position in [0, used), in order, then used
  const int64_t* runs;  // one word: the runs listed
  float* partials;  // [2 * blocks(n)][partial_stride]: the crossing runs' pieces (phase 1 -> phase 2)
  int64_t partial_stride;
};

// The positions that may hold ids: n, or fewer where the device word `used` says so.
PGAS_UPDATE_FN int64_t used_positions(const OwnerUpdateParams& p) {
  if (p.used == nullptr) return p.n;
  const int64_t used = *p.used;
  return used < 0 ? 0 : used < p.n ? used : p.n;
}

PGAS_UPDATE_HD int64_t blocks_of(int64_t positions) { return (positions + kOwnerBlock - 1) / kOwnerBlock; }

PGAS_UPDATE_FN int64_t key_at(const OwnerUpdateParams& p, int64_t q) {
  return p.keys32 != nullptr ? static_cast<int64_t>(p.keys32[q]) : p.keys64[q];
}

// Whether sorted position q starts a run (the list's entries).
PGAS_UPDATE_FN bool starts_run(const OwnerUpdateParams& p, int64_t q) {
  return q == 0 || key_at(p, q - 1) != key_at(p, q);
}

// The first position in [lo, hi) whose key is past `key` (hi if none): the keys are sorted.
PGAS_UPDATE_FN int64_t run_end(const OwnerUpdateParams& p, int64_t key, int64_t lo, int64_t hi) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (key_at(p, mid) <= key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// A bag's feature, bag in [0, F * batch) (< 2^31: checked on the host): a 32-bit division, where a 64-bit
// one is a long subroutine on a GPU.
PGAS_UPDATE_FN int64_t feature_of(const OwnerUpdateParams& p, int64_t bag) {
  return static_cast<int32_t>(bag) / static_cast<int32_t>(p.config.batch);
}

// The row a run updates: table -1 where its key lies outside every table's rows.
struct RunRow {
  int32_t table;
  int32_t row;  // < 2^31: checked on the host
};

// The row of `key`, its table found from the bag of the id at q (its feature's table: the table of nearly
// every id) and otherwise by a binary search over the tables' key ranges (the last with key_base <= key).
PGAS_UPDATE_FN RunRow run_row(const OwnerUpdateParams& p, int64_t key, int64_t q) {
  const int64_t bag = p.bags[q];
  int64_t t = bag >= 0 && bag < p.num_features * p.config.batch ? p.features[feature_of(p, bag)].table : -1;
  if (t < 0 || key < p.tables[t].key_base || key - p.tables[t].key_base >= p.tables[t].rows) {
    int64_t lo = 0, hi = p.num_tables;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (p.tables[mid].key_base <= key) lo = mid; else hi = mid;
    }
    t = lo;
  }
  const int64_t row = key - p.tables[t].key_base;
  if (row < 0 || row >= p.tables[t].rows) return {-1, 0};
  return {static_cast<int32_t>(t), static_cast<int32_t>(row)};
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

// The column lane `lane` of a kLanes-lane group holds as its j-th: four adjacent columns a lane, the group's
// 4 * kLanes columns, then the next 4 * kLanes (one lane: column j).
template <int kLanes>
PGAS_UPDATE_FN int column_of(int lane, int j) {
  return (j >> 2) * 4 * kLanes + 4 * lane + (j & 3);
}

// Elements [d, d + 4) of a row as fp32, those below dim (zeros past it): one 4-element load where `vector`
// (d + 4 <= dim, the row aligned), else one element at a time. The same values either way.
template <typename T>
PGAS_UPDATE_FN void load4(const T* row, int d, int dim, bool vector, float* out) {
#if defined(__CUDA_ARCH__)
  if (vector && d < dim) {
    if constexpr (sizeof(T) == 4) {
      const float4 v = *reinterpret_cast<const float4*>(row + d);
      out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(row + d);
      const T* e = reinterpret_cast<const T*>(&v);
      PGAS_UNROLL
      for (int k = 0; k < 4; ++k) out[k] = static_cast<float>(e[k]);
    }
    return;
  }
#else
  (void)vector;
#endif
  PGAS_UNROLL
  for (int k = 0; k < 4; ++k) out[k] = d + k < dim ? static_cast<float>(row[d + k]) : 0.f;
}

// Elements [d, d + 4) of a row, those below dim, rounded to T (to nearest).
template <typename T>
PGAS_UPDATE_FN void store4(T* row, int d, int dim, bool vector, const float* in) {
#if defined(__CUDA_ARCH__)
  if (vector && d < dim) {
    if constexpr (sizeof(T) == 4) {
      *reinterpret_cast<float4*>(row + d) = make_float4(in[0], in[1], in[2], in[3]);
    } else {
      uint2 v;
      T* e = reinterpret_cast<T*>(&v);
      PGAS_UNROLL
      for (int k = 0; k < 4; ++k) e[k] = static_cast<T>(in[k]);
      *reinterpret_cast<uint2*>(row + d) = v;
    }
    return;
  }
#else
  (void)vector;
#endif
  PGAS_UNROLL
  for (int k = 0; k < 4; ++k) {
    if (d + k < dim) row[d + k] = static_cast<T>(in[k]);
  }
}

// What a sorted id adds to its run: where its gradient row starts (-1: nothing: a bad bag, or a feature of
// another table than the run's), its per-sample weight and its MEAN factor.
struct IdTerm {
  int64_t src;
  float weight;
  float inv_length;
};

PGAS_UPDATE_FN IdTerm id_term(const OwnerUpdateParams& p, int64_t q, int32_t table) {
  const int64_t bag = p.bags[q];
  if (bag < 0 || bag >= p.num_features * p.config.batch) return {-1, 0.f, 0.f};
  const int64_t f = feature_of(p, bag);
  if (p.features[f].table != table) return {-1, 0.f, 0.f};
  const int64_t length = p.config.mean ? p.offsets[bag + 1] - p.offsets[bag] : 1;
  return {(bag - f * p.config.batch) * p.grad_row_stride + p.features[f].grad_col,
          p.config.weighted ? p.psw[q] : 1.f,
          length > 1 ? static_cast<float>(1.0 / static_cast<double>(length)) : 1.f};
}

// A run being summed: its row, and each of the lane's columns' compensated sum.
template <int kColumns>
struct RunSum {
  RunRow at;
  int dim;
  bool added;  // an id of the run added its term: a run of skipped ids only (corrupt) changes nothing
  float g[kColumns];
  float carry[kColumns];
};

template <typename Group>
PGAS_UPDATE_FN RunSum<Group::kColumns> empty_sum(const OwnerUpdateParams& p, RunRow at, Group group) {
  RunSum<Group::kColumns> s;
  s.at = at;
  s.dim = static_cast<int>(p.tables[at.table].dim);
  s.added = false;
  PGAS_UNROLL
  for (int j = 0; j < group.columns(s.dim); ++j) s.g[j] = s.carry[j] = 0.f;
  return s;
}

// One id's gradient row (the lane's columns), as FBGEMM's GPU backward forms its term: a MEAN bag's gradient
// times 1/length rounded to the gradient's dtype, then times the per-sample weight.
template <typename Group, typename grad_t>
PGAS_UPDATE_FN void load_term(const OwnerUpdateParams& p, const IdTerm& id, int dim, bool vector, Group group,
                              float* term) {
  const grad_t* row = static_cast<const grad_t*>(p.grad) + id.src;
  PGAS_UNROLL
  for (int j = 0; j < group.columns(dim); j += 4) load4(row, column_of<Group::kLanes>(group.lane, j), dim, vector,
                                                        term + j);
  PGAS_UNROLL
  for (int j = 0; j < group.columns(dim); ++j) {
    float s = term[j];
    if (p.config.mean) s = static_cast<float>(static_cast<grad_t>(mul_rn(s, id.inv_length)));
    if (p.config.weighted) s = mul_rn(s, id.weight);
    term[j] = s;
  }
}

// Adds one id's term to the run's sums (every lane holds the id's fields).
template <typename Group, typename grad_t>
PGAS_UPDATE_FN void add_id(const OwnerUpdateParams& p, const IdTerm& id, bool vector, Group group,
                           RunSum<Group::kColumns>& s) {
  if (id.src < 0) return;
  float term[Group::kColumns];
  load_term<Group, grad_t>(p, id, s.dim, vector, group, term);
  s.added = true;
  PGAS_UNROLL
  for (int j = 0; j < group.columns(s.dim); ++j) add_compensated(s.g[j], s.carry[j], term[j]);
}

// Adds the terms of positions [lo, hi) of one run, in sorted order: `first` (src -2: none) is position lo's,
// already read; then per kLanes positions their fields one a lane, broadcast through the group, kDepth ids'
// gradient rows loaded before the first of them is summed.
template <typename Group, typename grad_t>
PGAS_UPDATE_FN void sum_ids(const OwnerUpdateParams& p, int64_t lo, int64_t hi, const IdTerm& first, Group group,
                            RunSum<Group::kColumns>& s) {
  constexpr int kDepth = Group::kDepth, kColumns = Group::kColumns;
  const bool vector = p.grad_vectors && p.tables[s.at.table].vectors != 0;
  if (first.src != -2 && lo < hi) {
    add_id<Group, grad_t>(p, first, vector, group, s);
    ++lo;
  }
  for (int64_t q0 = lo; q0 < hi; q0 += Group::kLanes) {
    const int64_t q = q0 + group.lane;
    const IdTerm mine = q < hi ? id_term(p, q, s.at.table) : IdTerm{-1, 0.f, 0.f};
    const int count = hi - q0 < Group::kLanes ? static_cast<int>(hi - q0) : Group::kLanes;
    for (int i0 = 0; i0 < count; i0 += kDepth) {
      float term[kDepth][kColumns];
      bool adds[kDepth];
      PGAS_UNROLL
      for (int k = 0; k < kDepth; ++k) {  // loads only: kDepth ids' rows in flight
        const IdTerm id = group.broadcast(mine, i0 + k < count ? i0 + k : count - 1, p.config);
        adds[k] = i0 + k < count && id.src >= 0;
        if (adds[k]) load_term<Group, grad_t>(p, id, s.dim, vector, group, term[k]);
      }
      PGAS_UNROLL
      for (int k = 0; k < kDepth; ++k) {
        if (!adds[k]) continue;
        s.added = true;
        PGAS_UNROLL
        for (int j = 0; j < group.columns(s.dim); ++j) add_compensated(s.g[j], s.carry[j], term[k][j]);
      }
    }
  }
}

// A row's weights (the lane's columns) and row-wise momentum before the update, loaded as its run starts.
template <int kColumns>
struct RowBefore {
  float w[kColumns];
  float momentum;  // row-wise Adagrad's; else 0
};

template <typename Group, typename weight_t, Optimizer kOptimizer>
PGAS_UPDATE_FN RowBefore<Group::kColumns> load_before(const OwnerUpdateParams& p, RunRow at, Group group) {
  const OwnerTable& t = p.tables[at.table];
  const int dim = static_cast<int>(t.dim);
  const weight_t* w = static_cast<const weight_t*>(t.weights) + static_cast<int64_t>(at.row) * dim;
  RowBefore<Group::kColumns> before;
  PGAS_UNROLL
  for (int j = 0; j < group.columns(dim); j += 4) {
    load4(w, column_of<Group::kLanes>(group.lane, j), dim, t.vectors != 0, before.w + j);
  }
  before.momentum = kOptimizer == Optimizer::kRowwiseAdagrad ? t.momentum1[at.row] : 0.f;
  return before;
}

// One optimizer step of the run's row with its summed gradient (each column's compensated sum).
template <typename Group, typename weight_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void update_row(const OwnerUpdateParams& p, const RunSum<Group::kColumns>& s,
                               const RowBefore<Group::kColumns>& before, Group group) {
  constexpr int kColumns = Group::kColumns;
  const OwnerHyper h = *p.hyper;  // read per row: held across the runs, its eight words would cost occupancy
  const OwnerTable& table = p.tables[s.at.table];
  const int dim = s.dim;
  const bool vector = table.vectors != 0;
  const int64_t at = static_cast<int64_t>(s.at.row) * dim;
  float g[kColumns];
  PGAS_UNROLL
  for (int j = 0; j < group.columns(dim); ++j) g[j] = s.g[j];
  RowStep step{h.lr, 1.f};  // SGD
  const WeightDecay mode = p.config.weight_decay_mode;
  if (kOptimizer == Optimizer::kRowwiseAdagrad) {
    float squares = 0.f;
    PGAS_UNROLL
    for (int j = 0; j < group.columns(dim); ++j) {
      const float gd = column_of<Group::kLanes>(group.lane, j) < dim ? adagrad_decayed(g[j], before.w[j], h, mode)
                                                                     : 0.f;
      squares = fmaf(gd, gd, squares);
    }
    const float m = before.momentum + group.sum(squares) / static_cast<float>(dim);
    group.sync();  // every lane has read the old momentum
    if (group.lane == 0) table.momentum1[s.at.row] = m;
    step = adagrad_row_step(m, h, mode);
  }
  float out[kColumns];
  if (kOptimizer != Optimizer::kAdam) {
    PGAS_UNROLL
    for (int j = 0; j < group.columns(dim); ++j) out[j] = fmaf(-step.multiplier, g[j], step.correction * before.w[j]);
  } else {
    PGAS_UNROLL
    for (int j = 0; j < group.columns(dim); j += 4) {
      const int d = column_of<Group::kLanes>(group.lane, j);
      float m1[4], m2[4];
      load4(table.momentum1 + at, d, dim, vector, m1);
      load4(table.momentum2 + at, d, dim, vector, m2);
      PGAS_UNROLL
      for (int k = 0; k < 4; ++k) {
        const AdamColumn c = adam_column(before.w[j + k], g[j + k], m1[k], m2[k], h);
        out[j + k] = c.w, m1[k] = c.m1, m2[k] = c.m2;
      }
      store4(table.momentum1 + at, d, dim, vector, m1);
      store4(table.momentum2 + at, d, dim, vector, m2);
    }
  }
  weight_t* w = static_cast<weight_t*>(table.weights) + at;
  PGAS_UNROLL
  for (int j = 0; j < group.columns(dim); j += 4) store4(w, column_of<Group::kLanes>(group.lane, j), dim, vector,
                                                         out + j);
}

// A piece's partial, slot 2 * block + side: its column sums and carries as the lane holds them, and whether
// an id added a term.
template <typename Group>
PGAS_UPDATE_FN void store_partial(const OwnerUpdateParams& p, int64_t slot, const RunSum<Group::kColumns>& s,
                                  Group group) {
  float* out = p.partials + slot * p.partial_stride;
  const int64_t cols = (p.partial_stride - 1) / 2;
  PGAS_UNROLL
  for (int j = 0; j < group.columns(s.dim); ++j) {
    const int d = column_of<Group::kLanes>(group.lane, j);
    if (d < s.dim) {
      out[d] = s.g[j];
      out[cols + d] = s.carry[j];
    }
  }
  if (group.lane == 0) out[2 * cols] = s.added ? 1.f : 0.f;
}

// Adds a piece's partial to a run's compensated sum: its sum, then its carry taken back.
template <typename Group>
PGAS_UPDATE_FN void add_partial(const OwnerUpdateParams& p, int64_t slot, RunSum<Group::kColumns>& s, Group group) {
  const float* in = p.partials + slot * p.partial_stride;
  const int64_t cols = (p.partial_stride - 1) / 2;
  PGAS_UNROLL
  for (int j = 0; j < group.columns(s.dim); ++j) {
    const int d = column_of<Group::kLanes>(group.lane, j);
    if (d < s.dim) {
      add_compensated(s.g[j], s.carry[j], in[d]);
      add_compensated(s.g[j], s.carry[j], -in[cols + d]);
    }
  }
  s.added = s.added || in[2 * cols] != 0.f;
}

// What a run's group needs of it, read for a batch of runs one a lane (run_meta) and staged: its positions
// [lo, hi), its row (table -1: skipped) and its first id's term.
struct alignas(16) RunMeta {
  IdTerm first;
  int32_t lo, hi;  // < 2^31: checked on the host
  RunRow at;
};

PGAS_UPDATE_FN RunMeta run_meta(const OwnerUpdateParams& p, int64_t r) {
  RunMeta m{{-1, 0.f, 0.f}, p.run_begin[r], p.run_begin[r + 1], {-1, 0}};
  if (m.lo >= m.hi) return m;
  m.at = run_row(p, key_at(p, m.lo), m.lo);
  if (m.at.table >= 0) m.first = id_term(p, m.lo, m.at.table);
  return m;
}

// Phase 1, a run of the list: inside one block, summed and applied (its row's state loaded as it starts);
// crossing blocks, its first piece (to its block's end) summed into slot 1 of that block.
template <typename Group, typename weight_t, typename grad_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void sum_run(const OwnerUpdateParams& p, const RunMeta& m, Group group) {
  if (m.at.table < 0) return;
  RunSum<Group::kColumns> s = empty_sum(p, m.at, group);
  const int64_t block = m.lo / kOwnerBlock, block_end = (block + 1) * kOwnerBlock;
  if (m.hi > block_end) {
    sum_ids<Group, grad_t>(p, m.lo, block_end, m.first, group, s);
    return store_partial(p, 2 * block + 1, s, group);
  }
  const RowBefore<Group::kColumns> before = load_before<Group, weight_t, kOptimizer>(p, m.at, group);
  sum_ids<Group, grad_t>(p, m.lo, m.hi, m.first, group, s);
  if (s.added) update_row<Group, weight_t, kOptimizer>(p, s, before, group);
}

// Phase 1, block k's head piece: where a run enters the block from an earlier one, its positions in the block,
// summed into slot 0 of the block.
template <typename Group, typename grad_t>
PGAS_UPDATE_FN void sum_block_head(const OwnerUpdateParams& p, int64_t k, int64_t used, Group group) {
  const int64_t lo = k * kOwnerBlock;
  if (lo == 0 || lo >= used || starts_run(p, lo)) return;
  const int64_t key = key_at(p, lo);
  const RunRow at = run_row(p, key, lo);
  if (at.table < 0) return;
  RunSum<Group::kColumns> s = empty_sum(p, at, group);
  const int64_t hi = run_end(p, key, lo, lo + kOwnerBlock < used ? lo + kOwnerBlock : used);
  sum_ids<Group, grad_t>(p, lo, hi, IdTerm{-2, 0.f, 0.f}, group, s);
  store_partial(p, 2 * k, s, group);
}

// Phase 2, block k: where a run starts in the block and leaves it, its first piece's partial, then the head
// pieces' of the blocks it reaches, in block order; then its row's one update.
template <typename Group, typename weight_t, Optimizer kOptimizer>
PGAS_UPDATE_FN void combine_run(const OwnerUpdateParams& p, int64_t k, int64_t used, Group group) {
  const int64_t lo = k * kOwnerBlock, last = lo + kOwnerBlock - 1;
  if (last + 1 >= used) return;
  const int64_t key = key_at(p, last);
  if (key_at(p, last + 1) != key || (lo > 0 && key_at(p, lo - 1) == key)) return;  // ends here, or entered
  const RunRow at = run_row(p, key, last);
  if (at.table < 0) return;  // a key outside the tables: no piece was stored
  const RowBefore<Group::kColumns> before = load_before<Group, weight_t, kOptimizer>(p, at, group);
  RunSum<Group::kColumns> s = empty_sum(p, at, group);
  add_partial(p, 2 * k + 1, s, group);
  const int64_t last_block = (run_end(p, key, last + 1, used) - 1) / kOwnerBlock;
  for (int64_t b = k + 1; b <= last_block; ++b) add_partial(p, 2 * b, s, group);
  if (s.added) update_row<Group, weight_t, kOptimizer>(p, s, before, group);
}

// The GPU update (owner_update.cu): the run list and both phases on `stream`, for tables up to `max_dim` wide,
// its scratch (the run list, the partials) from `scratch(bytes)` (the host's: the stream's caching allocator,
// a capture's graph pool). Raw pointers only: the kernel file includes no tensor header.
void launch_owner_update(OwnerUpdateParams p, c10::ScalarType grad, c10::ScalarType weights, int64_t max_dim,
                         const std::function<void*(size_t)>& scratch, cudaStream_t stream);

// Calls fn(weight_t{}, grad_t{}, optimizer) for the update's weight and gradient dtypes and its optimizer (an
// std::integral_constant: each optimizer's phases are kernels of their own, without the others' branches).
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
