// The owner update on the GPU: the two phases of owner_update.h, a kernel
// each, with a group of a warp's lanes per chunk of sorted positions
// (grid-stride over the chunks, their size set by the used positions and the
// resident groups). A group's lanes read a batch of its width of positions'
// fields one a lane, then walk the positions together, splitting each row's
// columns. Phase 2 starts after phase 1's grid completes (stream order): the
// partials it reads are written.
// No host sync: the id count is the tensors' size (or a device word), the
// hyper-parameters are read on the device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "owner_update.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;
constexpr int kVecColumns = 4;  // a lane's contiguous columns: 16 bytes of fp32

// kLanes lanes of a warp as the walk's lanes (a warp holds 32 / kLanes walkers, each with its own chunks):
// kVectors vectors of kVec columns a lane (dim <= kLanes * kVectors * kVec, sized by the widest table of the
// launch), and as many ids' rows in flight (kDepth) as registers allow at kMinBlocks CTAs per SM. The groups
// of a warp may diverge (their walks differ): every shuffle, ballot and barrier names the group's lanes only.
// A narrow table's row is a few vectors: a group as wide as the row, so that one warp instruction serves
// 32 / kLanes ids (four columns a lane in one 16-byte load) where a warp with a column a lane served one.
template <int kLanes, int kVectors, int kVecColumns>
struct GroupLanes {
  static constexpr int kCount = kLanes;
  static constexpr int kVec = kVecColumns;
  static constexpr int kMaxColumns = kVectors * kVecColumns;
  static constexpr int kDepth = kMaxColumns <= 4 ? 2 : 1;
  static constexpr int kMinBlocks = kMaxColumns <= 4 ? 2 : 1;
  int lane;  // in the group
  int first_lane;  // the group's first lane in the warp
  unsigned mask;  // the group's lanes in the warp
  __device__ explicit GroupLanes(int warp_lane)
      : lane(warp_lane % kLanes),
        first_lane(warp_lane - warp_lane % kLanes),
        mask((kLanes == 32 ? 0xffffffffu : (1u << kLanes) - 1u) << (warp_lane - warp_lane % kLanes)) {}
  __device__ constexpr int columns(int) const { return kMaxColumns; }  // unrolled; column(j) < dim guards
  __device__ int column(int j) const { return ((j / kVec) * kLanes + lane) * kVec + j % kVec; }
  __device__ float sum(float x) const {
    for (int o = kLanes / 2; o > 0; o >>= 1) x += __shfl_xor_sync(mask, x, o, kLanes);
    return x;
  }
  __device__ unsigned ballot(bool flag) const { return (__ballot_sync(mask, flag) & mask) >> first_lane; }
  __device__ int first(unsigned bits) const { return __ffs(bits) - 1; }
  template <typename T>
  __device__ T broadcast(T x, int from) const { return __shfl_sync(mask, x, from, kLanes); }
  __device__ void sync() const { __syncwarp(mask); }
};

// The walkers' loop over the chunks of the used positions (grid-stride: an eager launch sized to its ids and a
// captured one sized to the capacity cut the same chunks, from `used` and the resident walkers).
template <typename Lanes, typename Walk>
__device__ __forceinline__ void for_each_chunk(const OwnerUpdateParams& p, Walk&& walk) {
  if (p.apply != nullptr && *p.apply == 0) return;  // a refused step: every walker reads the word first
  const Lanes lanes(static_cast<int>(threadIdx.x % 32));
  constexpr int kPerCta = kThreads / Lanes::kCount;
  const int64_t used = used_positions(p), size = chunk_positions(used, p.walkers);
  const int64_t chunks = (used + size - 1) / size, stride = static_cast<int64_t>(gridDim.x) * kPerCta;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kPerCta + threadIdx.x / Lanes::kCount; c < chunks;
       c += stride) {
    walk(c, size, used, lanes);
  }
}

template <typename weight_t, typename grad_t, Optimizer kOptimizer, typename Lanes>
__global__ void __launch_bounds__(kThreads, Lanes::kMinBlocks) owner_walk_kernel(OwnerUpdateParams p) {
  for_each_chunk<Lanes>(p, [&](int64_t c, int64_t size, int64_t used, Lanes lanes) {
    walk_chunk<Lanes, weight_t, grad_t, kOptimizer>(p, c, size, used, lanes);
  });
}

template <typename weight_t, typename grad_t, Optimizer kOptimizer, typename Lanes>
__global__ void __launch_bounds__(kThreads, Lanes::kMinBlocks) owner_finish_kernel(OwnerUpdateParams p) {
  for_each_chunk<Lanes>(p, [&](int64_t c, int64_t size, int64_t used, Lanes lanes) {
    finish_run<Lanes, weight_t, grad_t, kOptimizer>(p, c, size, used, lanes);
  });
}

// Both phases on the update's stream, as many CTAs as the positions fill with 32-id chunks, at most the
// resident ones (a captured step's capacity: every resident CTA, each reading how many positions are used).
// The partials live in the launch's own allocation (the stream's caching allocator; a capture's graph pool).
template <typename weight_t, typename grad_t, Optimizer kOptimizer, typename Lanes>
void launch(OwnerUpdateParams p, int64_t max_dim) {
  const auto walk = owner_walk_kernel<weight_t, grad_t, kOptimizer, Lanes>;
  constexpr int kPerCta = kThreads / Lanes::kCount;
  const int resident = resident_ctas(walk, kThreads);
  p.walkers = static_cast<int64_t>(resident) * kPerCta;
  const int64_t cols = (max_dim + 31) / 32 * 32;
  p.partial_stride = 2 * cols + 1;
  const at::Tensor partials = at::empty({max_chunks(p.n, p.walkers) * p.partial_stride},
                                        at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  p.partials = partials.data_ptr<float>();
  const int64_t needed = (p.n + kPerCta * 32 - 1) / (kPerCta * 32);
  const int blocks = static_cast<int>(std::min<int64_t>(needed, resident));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  walk<<<blocks, kThreads, 0, stream>>>(p);
  PGAS_CUDA_CHECK(cudaGetLastError());
  owner_finish_kernel<weight_t, grad_t, kOptimizer, Lanes><<<blocks, kThreads, 0, stream>>>(p);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void owner_update_cuda(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& offsets,
                       const c10::optional<at::Tensor>& psw, const at::Tensor& grad,
                       at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                       const at::Tensor& features, const at::Tensor& hyper, const at::Tensor& config,
                       const c10::optional<at::Tensor>& apply, const c10::optional<at::Tensor>& used) {
  PGAS_CHECK(!weights.empty(), "owner_update: no table");
  const c10::cuda::CUDAGuard guard(grad.device());
  std::vector<at::Tensor> on_device;  // the descriptors' device copies
  const OwnerUpdateParams p = owner_update_params(keys, bags, offsets, psw, grad, weights, momentum1, momentum2,
                                                  features, hyper, config, apply, used, on_device);
  const int64_t max_dim = widest_dim(weights);
  const bool vectors = rows_in_vectors(kVecColumns, grad, weights, momentum1, momentum2, features, p.config);
  dispatch_owner_update(grad.scalar_type(), weights[0].scalar_type(), p.config.optimizer,
                        [&](auto weight, auto grad_type, auto optimizer) {
    if (p.n == 0) return;
    using weight_t = decltype(weight);
    using grad_t = decltype(grad_type);
    constexpr Optimizer kOptimizer = decltype(optimizer)::value;
    if (!vectors) {  // a column a lane: any dim, any alignment
      launch<weight_t, grad_t, kOptimizer, GroupLanes<32, kOwnerMaxDim / 32, 1>>(p, max_dim);
    } else if (max_dim <= 8 * kVecColumns) {
      launch<weight_t, grad_t, kOptimizer, GroupLanes<8, 1, kVecColumns>>(p, max_dim);
    } else if (max_dim <= 16 * kVecColumns) {
      launch<weight_t, grad_t, kOptimizer, GroupLanes<16, 1, kVecColumns>>(p, max_dim);
    } else if (max_dim <= 32 * kVecColumns) {
      launch<weight_t, grad_t, kOptimizer, GroupLanes<32, 1, kVecColumns>>(p, max_dim);
    } else {
      launch<weight_t, grad_t, kOptimizer, GroupLanes<32, kOwnerMaxDim / (32 * kVecColumns), kVecColumns>>(p, max_dim);
    }
  });
}

}  // namespace torchrec_pgas
