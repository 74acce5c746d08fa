// The owner update on the GPU: the algorithm of owner_update.h with a group of
// lanes per row run. A warp takes 32 consecutive sorted positions
// (grid-stride), finds the runs that start there with one ballot, and deals
// them to its groups round-robin, the groups walking theirs side by side: a
// run's walk and its row's update are uniform over its group, whose lanes
// split the row's columns. No host sync: the id
// count is the tensors' size, the hyper-parameters are read on the device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "owner_update.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// A group of kGroup lanes (8, 16 or 32) of a warp walks one run; a warp's
// groups walk different runs at once, so narrow rows keep more rows in flight
// per warp. kColumns: a lane's sums (dim <= kGroup * kColumns), sized by the
// widest table of the launch (registers bound the warps per SM). Every
// exchange names the group's lanes only: groups diverge, each on its own run.
template <int kGroup, int kColumns>
struct GroupLanes {
  static constexpr int kCount = kGroup;
  static constexpr int kMaxColumns = kColumns;
  int lane;  // within the group
  unsigned mask;  // the group's lanes in the warp
  __device__ constexpr int columns(int) const { return kColumns; }  // unrolled; d < dim guards
  __device__ float sum(float x) const {
    for (int o = kGroup / 2; o > 0; o >>= 1) x += __shfl_xor_sync(mask, x, o, kGroup);
    return x;
  }
  __device__ int count(bool flag) const { return __popc(__ballot_sync(mask, flag) & mask); }
  template <typename T>
  __device__ T broadcast(T x, int from) const { return __shfl_sync(mask, x, from, kGroup); }
  __device__ void sync() const { __syncwarp(mask); }
};

template <typename weight_t, typename grad_t, int kGroup, int kColumns>
__global__ void __launch_bounds__(kThreads) owner_update_kernel(OwnerUpdateParams p) {
  constexpr int kGroups = 32 / kGroup;
  const int lane = threadIdx.x % 32, group = lane / kGroup;
  const unsigned mask = kGroup == 32 ? 0xffffffffu : ((1u << (kGroup % 32)) - 1u) << (group * kGroup);
  const GroupLanes<kGroup, kColumns> lanes{lane % kGroup, mask};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * 32;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * 32; base < p.n;
       base += stride) {
    // The runs that start here, dealt round-robin: the group's are bits group, group + kGroups, ... of
    // `starts`. Every group walks its next run in the same iteration (trip counts differ by one at most),
    // so the groups' loads issue together instead of one group's run at a time.
    unsigned mine = __ballot_sync(0xffffffffu, starts_run(p, base + lane));
    for (int s = 0; s < group; ++s) mine &= mine - 1;
    while (mine != 0) {
      update_run<GroupLanes<kGroup, kColumns>, weight_t, grad_t>(p, base + __ffs(mine) - 1, lanes);
      for (int s = 0; s < kGroups; ++s) mine &= mine - 1;
    }
  }
}

template <typename weight_t, typename grad_t, int kGroup, int kColumns>
void launch(const OwnerUpdateParams& p) {
  const auto kernel = owner_update_kernel<weight_t, grad_t, kGroup, kColumns>;
  const int64_t needed = (p.n + kWarps * 32 - 1) / (kWarps * 32);
  const int blocks = static_cast<int>(std::min<int64_t>(needed, resident_ctas(kernel, kThreads)));
  kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void owner_update_cuda(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& offsets, const c10::optional<at::Tensor>& psw, const at::Tensor& grad,
                       at::TensorList weights, at::TensorList momentum1, at::TensorList momentum2,
                       const at::Tensor& features, const at::Tensor& hyper, const at::Tensor& config) {
  PGAS_CHECK(!weights.empty(), "owner_update: no table");
  const c10::cuda::CUDAGuard guard(grad.device());
  std::vector<at::Tensor> on_device;  // descriptors on the device, alive until the launch is queued
  const OwnerUpdateParams p = owner_update_params(keys, bags, offsets, psw, grad, weights, momentum1, momentum2,
                                                  features, hyper, config, on_device);
  int64_t max_dim = 0;
  for (const at::Tensor& w : weights) max_dim = std::max<int64_t>(max_dim, w.size(1));
  dispatch_owner_update(grad.scalar_type(), weights[0].scalar_type(), [&](auto weight, auto grad_type) {
    if (p.n == 0) return;
    using weight_t = decltype(weight);
    using grad_t = decltype(grad_type);
    if (max_dim <= 32) {  // four runs in flight per warp up to dim 64, two up to 128
      launch<weight_t, grad_t, 8, 4>(p);
    } else if (max_dim <= 64) {
      launch<weight_t, grad_t, 8, 8>(p);
    } else if (max_dim <= 128) {
      launch<weight_t, grad_t, 16, 8>(p);
    } else {
      launch<weight_t, grad_t, 32, kOwnerMaxDim / 32>(p);
    }
  });
}

}  // namespace torchrec_pgas
