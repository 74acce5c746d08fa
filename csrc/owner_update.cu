// The owner update on the GPU: the walk of owner_update.h with a warp per
// chunk of sorted positions (grid-stride over the chunks, their size set by
// the ids per warp). The warp's lanes read a batch of 32 positions' fields one
// a lane, then walk the positions together, splitting each row's columns. No
// host sync: the id count is the tensors' size (or a device word), the
// hyper-parameters are read on the device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "owner_update.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// A warp as the walk's lanes: kColumns columns a lane (dim <= 32 * kColumns,
// sized by the widest table of the launch), and as many ids' rows in flight
// (kDepth) as registers allow at kMinBlocks CTAs per SM. Chosen by measurement
// (benchmarks/NOTES.md §33, §35): up to dim 64, 4 CTAs at 64 registers, where
// ptxas (nvcc 13.0, sm_90a, -Xptxas -v) spills up to 60 bytes in some
// instantiations, beat 3 CTAs without spills; wider rows spill nothing.
template <int kColumns>
struct WarpLanes {
  static constexpr int kCount = 32;
  static constexpr int kMaxColumns = kColumns;
  static constexpr int kDepth = kColumns == 1 ? 3 : kColumns == 2 ? 2 : kColumns <= 4 ? 2 : 1;
  static constexpr int kMinBlocks = kColumns <= 2 ? 4 : kColumns <= 4 ? 2 : 1;
  int lane;
  __device__ constexpr int columns(int) const { return kColumns; }  // unrolled; d < dim guards
  __device__ float sum(float x) const {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
  }
  __device__ unsigned ballot(bool flag) const { return __ballot_sync(0xffffffffu, flag); }
  __device__ int first(unsigned mask) const { return __ffs(mask) - 1; }
  template <typename T>
  __device__ T broadcast(T x, int from) const { return __shfl_sync(0xffffffffu, x, from); }
  __device__ void sync() const { __syncwarp(); }
};

// A chunk is walked serially by one warp, so a step's ids spread over every
// walker: kOwnerChunk positions a chunk where there are that many per walker,
// down to one batch of 32 (a small step's walk is a few dependent loads per
// id; in 256-id chunks it would run on n / 256 warps).
__device__ __forceinline__ int64_t walker_chunk(int64_t n, int64_t walkers) {
  const int64_t per_walker = (n + walkers - 1) / walkers;
  const int64_t batches = (per_walker + 31) / 32;
  return batches < 1 ? 32 : batches * 32 < kOwnerChunk ? batches * 32 : kOwnerChunk;
}

template <typename weight_t, typename grad_t, Optimizer kOptimizer, int kColumns>
__global__ void __launch_bounds__(kThreads, WarpLanes<kColumns>::kMinBlocks)
    owner_update_kernel(OwnerUpdateParams p) {
  if (p.apply != nullptr && *p.apply == 0) return;  // a refused step: every walker reads the word first
  const WarpLanes<kColumns> lanes{static_cast<int>(threadIdx.x % 32)};
  const int64_t n = used_positions(p), walkers = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t chunk = walker_chunk(n, walkers), chunks = (n + chunk - 1) / chunk;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; c < chunks; c += walkers) {
    walk_chunk<WarpLanes<kColumns>, weight_t, grad_t, kOptimizer>(p, c * chunk, c * chunk + chunk, lanes);
  }
}

// As many CTAs as the positions fill with 32-id chunks, at most the resident ones (a captured step's
// capacity: every resident CTA, each reading how many positions are used).
template <typename weight_t, typename grad_t, Optimizer kOptimizer, int kColumns>
void launch(const OwnerUpdateParams& p) {
  const auto kernel = owner_update_kernel<weight_t, grad_t, kOptimizer, kColumns>;
  const int64_t needed = (p.n + kWarps * 32 - 1) / (kWarps * 32);
  const int blocks = static_cast<int>(std::min<int64_t>(needed, resident_ctas(kernel, kThreads)));
  kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
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
  int64_t max_dim = 0;
  for (const at::Tensor& w : weights) max_dim = std::max<int64_t>(max_dim, w.size(1));
  dispatch_owner_update(grad.scalar_type(), weights[0].scalar_type(), p.config.optimizer,
                        [&](auto weight, auto grad_type, auto optimizer) {
    if (p.n == 0) return;
    using weight_t = decltype(weight);
    using grad_t = decltype(grad_type);
    constexpr Optimizer kOptimizer = decltype(optimizer)::value;
    if (max_dim <= 32) {
      launch<weight_t, grad_t, kOptimizer, 1>(p);
    } else if (max_dim <= 64) {
      launch<weight_t, grad_t, kOptimizer, 2>(p);
    } else if (max_dim <= 128) {
      launch<weight_t, grad_t, kOptimizer, 4>(p);
    } else {
      launch<weight_t, grad_t, kOptimizer, kOwnerMaxDim / 32>(p);
    }
  });
}

}  // namespace torchrec_pgas
