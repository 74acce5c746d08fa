// The owner backward's update: one step of FBGEMM's exact optimizers (EXACT_SGD,
// EXACT_ROWWISE_ADAGRAD, ADAM) applied by an owner to the rows of its TBE that
// its sources' gradients touch, in the TBE's own weight and optimizer-state
// storage. One algorithm, written once: owner_update.cu runs it with a group
// of lanes per row, owner_update_host.cpp with a CPU thread per row (the CPU path, the
// same code); torchrec_pgas/sharding/owner_backward.py is its torch-ops
// reference.
//
// Inputs, n kept ids of one TBE (the owner's rebuild of the ids stock hands
// its TBE, PgasStep.kept_ids: feature-major, then source, then sample), in
// the order of their sorted row keys (a stable sort: a row's ids in arrival
// order):
//   keys[n]   the ids' row keys, sorted, int32 or int64: table t's row r is
//             key_base[t] + r, key_base the running sum of the tables' rows
//   bags[n]   each sorted id's bag, feature * batch + sample (int32; the
//             gradient's row is the sample, its columns the feature's)
//   offsets   the kept ids' bag offsets [F * batch + 1] (a MEAN bag's length)
//   psw[n]    each sorted id's per-sample weight, or none
//   grad      the pooled gradient, [batch][>= grad_col + dim] per feature
// The ids' metadata comes in sorted order so that a run reads it as one
// coalesced segment: a run's chain of dependent loads is its keys and bags,
// then its gradient rows beside its weight row (loaded before the sum, which
// does not need it), then the update's stores. A row's ids form one run of
// equal keys. The run's first position walks it
// in sorted order, which is arrival order (the sort is stable), a group of
// lanes' width of ids at a time (each lane reads one id's bag, weight and length, then the lanes take
// the ids' gradient rows in order). Each id's term is as FBGEMM's GPU backward
// Bounds: the host checks every table view and feature descriptor against the
// tensors they name (owner_update_host.cpp). On the device a key outside
// every table's rows, a bag outside [0, F * batch) or an id of a feature of
// another table than its key's is skipped: the keys decide the rows written,
// the bags the gradient read.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "pgas_check.h"
#include "step_abi.h"

#if defined(__CUDACC__)
#define PGAS_UPDATE_FN __device__ __forceinline__
#define PGAS_UNROLL _Pragma("unroll")
#define PGAS_UNROLL_4 _Pragma("unroll 4")
#else
#define PGAS_UPDATE_FN inline
#define PGAS_UNROLL
#define PGAS_UNROLL_4
#endif

namespace torchrec_pgas {

// Largest table dim the update takes (a GPU lane holds up to dim / 32 sums).
constexpr int kOwnerMaxDim = 512;

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
};

PGAS_UPDATE_FN int64_t key_at(const OwnerUpdateParams& p, int64_t q) {
  return p.keys32 != nullptr ? static_cast<int64_t>(p.keys32[q]) : p.keys64[q];
}

// Whether sorted position q starts a run (a row's first id).
PGAS_UPDATE_FN bool starts_run(const OwnerUpdateParams& p, int64_t q) {
  return q < p.n && (q == 0 || key_at(p, q) != key_at(p, q - 1));
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
  const float correction = mode == WeightDecay::kL2        ? 1.f - multiplier * h.weight_decay
                           : mode == WeightDecay::kDecouple ? 1.f - h.lr * h.weight_decay
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

// Lanes (a group of a warp's lanes, or one CPU thread) split a row's columns: lane l holds
// columns l, l + kCount, ... in g[0, columns(dim)), at most kMaxColumns; sum
// adds a value over the lanes, count the lanes whose flag is set, broadcast
// gives lane i's value to all, sync orders the lanes' reads of a row's state
// before a write.

// One id's part of a run: where its gradient row starts (-1: skipped), its
// per-sample weight and its MEAN factor.
struct RunId {
  int64_t src;
  float weight;
  float inv_length;
};

PGAS_UPDATE_FN RunId run_id(const OwnerUpdateParams& p, int64_t q, int64_t table) {
  const int64_t bag = p.bags[q];
  if (bag < 0 || bag >= p.num_features * p.config.batch) return {-1, 0.f, 0.f};
  const int64_t f = bag / p.config.batch;
  if (p.features[f].table != table) return {-1, 0.f, 0.f};
  const int64_t length = p.config.mean ? p.offsets[bag + 1] - p.offsets[bag] : 1;
  return {(bag - f * p.config.batch) * p.grad_row_stride + p.features[f].grad_col,
          p.config.weighted ? p.psw[q] : 1.f,
          length > 1 ? static_cast<float>(1.0 / static_cast<double>(length)) : 1.f};
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

// The summed gradient of the run that starts at sorted position `start`
// (rows of `table`) into g, in arrival order.
template <typename Lanes, typename grad_t>
PGAS_UPDATE_FN void sum_run(const OwnerUpdateParams& p, int64_t start, int64_t table, Lanes lanes, float* g) {
  const grad_t* grad = static_cast<const grad_t*>(p.grad);
  const int dim = static_cast<int>(p.tables[table].dim);
  const int64_t key = key_at(p, start);
  float carry[Lanes::kMaxColumns];
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) g[j] = carry[j] = 0.f;
  for (int64_t q0 = start; q0 < p.n && key_at(p, q0) == key; q0 += Lanes::kCount) {
    const int64_t q = q0 + lanes.lane;
    const bool in_run = q < p.n && key_at(p, q) == key;  // the run's ids are a prefix of the lanes
    const RunId mine = in_run ? run_id(p, q, table) : RunId{-1, 0.f, 0.f};
    const int ids = lanes.count(in_run);
    // Branch-free and unrolled: the gradient rows of several ids are loading at once.
    PGAS_UNROLL_4
    for (int i = 0; i < ids; ++i) {
      const int64_t src = lanes.broadcast(mine.src, i);
      const float weight = lanes.broadcast(mine.weight, i), inv_length = lanes.broadcast(mine.inv_length, i);
      PGAS_UNROLL
      for (int j = 0; j < lanes.columns(dim); ++j) {
        const int d = lanes.lane + j * Lanes::kCount;
        const bool take = src >= 0 && d < dim;
        float s = take ? static_cast<float>(grad[src + d]) : 0.f;
        if (p.config.mean) s = static_cast<float>(static_cast<grad_t>(mul_rn(s, inv_length)));
        if (p.config.weighted) s = mul_rn(s, weight);
        float sum = g[j], lost = carry[j];
        add_compensated(sum, lost, s);
        g[j] = take ? sum : g[j];
        carry[j] = take ? lost : carry[j];
      }
    }
  }
}

// A row's weights (the lane's columns) and row-wise momentum as they were
// before the update: loaded before the row's gradient is summed, since they do
// not depend on it, so that their loads overlap the gradient rows'.
template <int kMaxColumns>
struct RowBefore {
  float w[kMaxColumns];
  float momentum;  // row-wise Adagrad's; else 0
};

template <typename Lanes, typename weight_t>
PGAS_UPDATE_FN void load_row(const OwnerTable& table, int64_t row, const OwnerUpdateConfig& config, Lanes lanes,
                             RowBefore<Lanes::kMaxColumns>& before) {
  const int dim = static_cast<int>(table.dim);
  const weight_t* w = static_cast<const weight_t*>(table.weights) + row * dim;
  PGAS_UNROLL
  for (int j = 0; j < lanes.columns(dim); ++j) {
    const int d = lanes.lane + j * Lanes::kCount;
    before.w[j] = d < dim ? static_cast<float>(w[d]) : 0.f;
  }
  before.momentum = config.optimizer == Optimizer::kRowwiseAdagrad ? table.momentum1[row] : 0.f;
}

// One optimizer step of `row` of `table` with its summed gradient g.
template <typename Lanes, typename weight_t>
PGAS_UPDATE_FN void update_row(const OwnerTable& table, int64_t row, const OwnerHyper& h,
                               const OwnerUpdateConfig& config, Lanes lanes, const float* g,
                               const RowBefore<Lanes::kMaxColumns>& before) {
  const int dim = static_cast<int>(table.dim);
  weight_t* w = static_cast<weight_t*>(table.weights) + row * dim;
  RowStep step{h.lr, 1.f};  // SGD
  if (config.optimizer == Optimizer::kRowwiseAdagrad) {
    float squares = 0.f;
    PGAS_UNROLL
    for (int j = 0; j < lanes.columns(dim); ++j) {
      const int d = lanes.lane + j * Lanes::kCount;
      const float gd = d < dim ? adagrad_decayed(g[j], before.w[j], h, config.weight_decay_mode) : 0.f;
      squares = fmaf(gd, gd, squares);
    }
    const float m = before.momentum + lanes.sum(squares) / static_cast<float>(dim);
    lanes.sync();  // every lane has read the old momentum (load_row)
    if (lanes.lane == 0) table.momentum1[row] = m;
    step = adagrad_row_step(m, h, config.weight_decay_mode);
  }
  float* m1 = config.optimizer == Optimizer::kAdam ? table.momentum1 + row * dim : nullptr;
  float* m2 = config.optimizer == Optimizer::kAdam ? table.momentum2 + row * dim : nullptr;
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

// Applies the run that starts at sorted position `start`.
template <typename Lanes, typename weight_t, typename grad_t>
PGAS_UPDATE_FN void update_run(const OwnerUpdateParams& p, int64_t start, Lanes lanes) {
  const int64_t key = key_at(p, start);
  const int64_t table = table_of(p, key);
  const int64_t row = key - p.tables[table].key_base;
  if (row < 0 || row >= p.tables[table].rows) return;
  RowBefore<Lanes::kMaxColumns> before;
  load_row<Lanes, weight_t>(p.tables[table], row, p.config, lanes, before);
  float g[Lanes::kMaxColumns];
  sum_run<Lanes, grad_t>(p, start, table, lanes, g);
  update_row<Lanes, weight_t>(p.tables[table], row, *p.hyper, p.config, lanes, g, before);
}

// Host side (owner_update_host.cpp): the op's inputs checked, naming the bad
// one, and the kernels' parameters built from them, their tables and feature
// descriptors copied to the inputs' device into `on_device` (which must
// outlive the launch). The gradient's dtype is checked by the dispatch.
OwnerUpdateParams owner_update_params(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& offsets, const c10::optional<at::Tensor>& psw,
                                              const at::Tensor& grad, at::TensorList weights,
                                              at::TensorList momentum1, at::TensorList momentum2,
                                              const at::Tensor& features, const at::Tensor& hyper,
                                              const at::Tensor& config, std::vector<at::Tensor>& on_device);

// Calls fn(weight_t{}, grad_t{}) for the update's weight and gradient dtypes.
template <typename Fn>
void dispatch_owner_update(at::ScalarType grad, at::ScalarType weights, Fn&& fn) {
  PGAS_CHECK(weights == at::kFloat || weights == at::kHalf, "owner_update: weights are %s, not fp32 or fp16",
             c10::toString(weights));
  auto with_grad = [&](auto weight) {
    switch (grad) {
      case at::kFloat: return fn(weight, float{});
      case at::kHalf: return fn(weight, c10::Half{});
      case at::kBFloat16: return fn(weight, c10::BFloat16{});
      default: PGAS_CHECK(false, "owner_update: gradient dtype %s is not fp32, fp16 or bf16", c10::toString(grad));
    }
  };
  if (weights == at::kHalf) {
    with_grad(c10::Half{});
  } else {
    with_grad(float{});
  }
}

}  // namespace torchrec_pgas
