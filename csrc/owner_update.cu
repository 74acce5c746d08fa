// The owner update on the GPU: the algorithm of owner_update.h with a warp per
// row run. A warp takes 32 consecutive sorted positions (grid-stride), finds
// the runs that start there with one ballot, and applies each: the run's walk
// and its row's update are uniform over the warp, its lanes split the row's
// columns. No host sync: the id count is the tensors' size, the
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

// kMaxColumns: a lane's sums, sized by the widest table of the launch (registers bound the warps per SM).
template <int kColumns>
struct WarpLanes {
  static constexpr int kCount = 32;
  static constexpr int kMaxColumns = kColumns;
  int lane;
  __device__ constexpr int columns(int) const { return kColumns; }  // unrolled; d < dim guards
  __device__ float sum(float x) const {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
  }
  __device__ int count(bool flag) const { return __popc(__ballot_sync(0xffffffffu, flag)); }
  template <typename T>
  __device__ T broadcast(T x, int from) const { return __shfl_sync(0xffffffffu, x, from); }
  __device__ void sync() const { __syncwarp(); }
};

template <typename weight_t, typename grad_t, int kColumns>
__global__ void __launch_bounds__(kThreads) owner_update_kernel(OwnerUpdateParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * 32;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * 32; base < p.n;
       base += stride) {
    unsigned starts = __ballot_sync(0xffffffffu, starts_run(p, base + lane));
    while (starts != 0) {
      const int i = __ffs(starts) - 1;
      starts &= starts - 1;
      update_run<WarpLanes<kColumns>, weight_t, grad_t>(p, base + i, WarpLanes<kColumns>{lane});
    }
  }
}

template <typename weight_t, typename grad_t, int kColumns>
void launch(const OwnerUpdateParams& p) {
  const auto kernel = owner_update_kernel<weight_t, grad_t, kColumns>;
  const int64_t needed = (p.n + kWarps * 32 - 1) / (kWarps * 32);
  const int blocks = static_cast<int>(std::min<int64_t>(needed, resident_ctas(kernel, kThreads)));
  kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void owner_update_cuda(const at::Tensor& keys, const at::Tensor& order, const at::Tensor& bags,
                       const at::Tensor& offsets, const c10::optional<at::Tensor>& psw, const at::Tensor& grad,
                       at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                       const at::Tensor& features, const at::Tensor& hyper, const at::Tensor& config) {
  PGAS_CHECK(!weights.empty(), "owner_update: no table");
  const c10::cuda::CUDAGuard guard(grad.device());
  std::vector<at::Tensor> on_device;  // descriptors on the device, alive until the launch is queued
  const OwnerUpdateParams p = owner_update_params(keys, order, bags, offsets, psw, grad, weights, momentum1, momentum2,
                                                  features, hyper, config, on_device);
  int64_t max_dim = 0;
  for (const at::Tensor& w : weights) max_dim = std::max<int64_t>(max_dim, w.size(1));
  dispatch_owner_update(grad.scalar_type(), weights[0].scalar_type(), [&](auto weight, auto grad_type) {
    if (p.n == 0) return;
    if (max_dim <= 128) {
      launch<decltype(weight), decltype(grad_type), 4>(p);
    } else {
      launch<decltype(weight), decltype(grad_type), kOwnerMaxDim / 32>(p);
    }
  });
}

}  // namespace torchrec_pgas
