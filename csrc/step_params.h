// What a stage kernel of the step gets, and the stages' launches: the seam
// between the ops' host side (step_ops.cpp: tensors checked into StepParams)
// and the kernel files (index_dist.cu, pooled_lookup.cu, combine_partials.cu,
// grad_exchange.cu), which see raw pointers and a stream, never a tensor.
// Host and device code alike include it (no ATen).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "step_abi.h"

namespace torchrec_pgas {

// The step's config plus this rank's device state.
struct StepParams : StepConfig {
  uint8_t* buf;  // this rank's symmetric buffer
  int64_t* pad;  // this rank's signal pad
  const int64_t* peer_bufs;  // [W] addresses of every rank's buffer (nvshmem_ptr)
  const int64_t* peer_pads;  // [W] addresses of every rank's pad
  const FeatureDesc* features;  // [F]
  int64_t* state;  // [kStateWords] device scratch (StateWord)
  float* bag_div;  // [num_slots][F*Bmax] MEAN divisors of this rank's bags
  ErrorRecord* status;  // pinned host mirror of the error record
  int64_t batch, nnz;  // this step, this rank
};

// The element type of a step's outputs and gradients (the kernels' out_t).
enum class StepFloat : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

// index_dist's flags (index_dist.cu).
constexpr int kGiveUp = 1;  // the host gave the step up: publish empty index blocks
constexpr int kAbortOnFailure = 2;  // a training step: a failure here aborts every owner

// The launches, each on `stream`, its arguments checked by the op that calls it. `values` are int64 ids if
// `ids64`, else int32; `weights` null when unweighted. A launch error raises.
void launch_index_dist(const StepParams& p, const void* values, bool ids64, const int64_t* offsets,
                       const float* weights, int flags, cudaStream_t stream);
void launch_pooled_lookup(const StepParams& p, int group_lanes, StepFloat out_type, bool after_exit, bool release,
                          cudaStream_t stream);
void launch_combine_partials(const StepParams& p, void* out, StepFloat out_type, const int32_t* col_feature,
                             cudaStream_t stream);
void launch_grad_dist(const StepParams& p, const void* grad, StepFloat grad_type, int64_t epoch, float inv_divisor,
                      bool abort, cudaStream_t stream);
void launch_await_grads(const StepParams& p, int64_t* flags, int64_t epoch, cudaStream_t stream);
void launch_release_sources(const StepParams& p, int64_t epoch, cudaStream_t stream);

}  // namespace torchrec_pgas
