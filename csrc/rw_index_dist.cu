// Stage 1 (requester), staged path: bucketize + scatter ids straight into the
// owners, one kernel (rw_dist.cuh: the tile protocol and bounds).
//
// Completion: fence + done counter; the last CTA writes the header, the final
// offset and the epoch into every owner's index slot of chunk 0, then advances
// the stage epoch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "rw_dist.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kWarps = 8;

// kTrace: the comm-timeline build (profiling); the default build has none of its code.
template <typename index_t, typename row_t, bool kTrace>
__global__ void __launch_bounds__(kWarps * 32, 4)
    rw_index_dist_kernel(RwParams p, const index_t* __restrict__ values,
                         const int64_t* __restrict__ offsets, const float* __restrict__ weights,
                         int group_lanes, int tile_bags) {
  extern __shared__ int32_t s_tile[];  // [kWarps][W][32]: TileSmem.tile_len per warp
  __shared__ int32_t s_begin[kWarps][32];
  __shared__ int32_t s_owners[kWarps][32];
  __shared__ uint8_t* s_dst[kMaxWorld];  // owner d's copy of this rank's index block
  __shared__ int64_t s_epoch;
  if (threadIdx.x == 0) s_epoch = p.state[kCtrIndex] + 1;
  if (kTrace && threadIdx.x == 0 && blockIdx.x == 0) {
    // Record 0: the step's start (profiling.comm_timeline zeroes the counter first).
    reinterpret_cast<int64_t*>(p.state[kTraceBuf])[0] = static_cast<int64_t>(global_timer_ns());
  }
  __syncthreads();
  const int64_t epoch = s_epoch;
  const int64_t slot = epoch % p.num_slots;
  const int64_t my_block = index_block(p, slot, p.rank);
  if (threadIdx.x < p.world) s_dst[threadIdx.x] = reinterpret_cast<uint8_t*>(p.peer_bufs[threadIdx.x]) + my_block;
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const TileSmem smem{s_tile + warp * p.world * 32, s_begin[warp], s_owners[warp]};
  float* bag_div = p.bag_div + slot * p.num_features * p.max_batch;
  const int num_bags = static_cast<int>(p.num_features * p.batch);
  // Warp gw takes tiles gw, gw + total_warps, ... (one wave: an even share each).
  const int total_warps = static_cast<int>(gridDim.x) * kWarps;
  for (int tile = static_cast<int>(blockIdx.x) * kWarps + warp; tile * tile_bags < num_bags; tile += total_warps) {
    distribute_tile<index_t, row_t, kTrace>(p, s_dst, values, offsets, weights, bag_div, group_lanes, tile_bags,
                                            tile, smem);
  }

  __syncthreads();
  if (threadIdx.x == 0 && last_to_arrive(p.state + kDoneIndex, gridDim.x)) {
    for (int d = 0; d < p.world; ++d) {
      uint8_t* dst = reinterpret_cast<uint8_t*>(p.peer_bufs[d]) + my_block;
      write_header(p, dst, epoch, 0);
    }
    __threadfence_system();
    for (int d = 0; d < p.world; ++d) {
      int64_t* peer_pad = reinterpret_cast<int64_t*>(p.peer_pads[d]);
      st_release_sys(peer_pad + index_signal(p, 0, p.rank), epoch);
    }
    p.state[kCtrIndex] = epoch;
  }
}

template <typename index_t, typename row_t, bool kTrace>
void launch_index_dist(const RwParams& p, const index_t* values, const int64_t* offsets,
                       const float* weights, cudaStream_t stream) {
  const int64_t num_bags = p.num_features * p.batch;
  const auto kernel = rw_index_dist_kernel<index_t, row_t, kTrace>;
  const int smem = kWarps * p.world * 32 * static_cast<int>(sizeof(int32_t));  // W KiB
  // One device per process; the occupancy depends on W (shared memory), so it is
  // recomputed when a sharding of another world size launches.
  static int resident_for_world = -1, resident = 0;
  if (resident_for_world != p.world) {
    if (smem > 48 * 1024) {
      PGAS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    resident = resident_ctas(kernel, kWarps * 32, smem);
    resident_for_world = p.world;
  }
  int group_lanes, tile_bags;
  dist_shape(num_bags, p.nnz, static_cast<int64_t>(resident) * kWarps, group_lanes, tile_bags);
  const int64_t bags_per_cta = kWarps * tile_bags;
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((num_bags + bags_per_cta - 1) / bags_per_cta, resident)));
  kernel<<<grid, kWarps * 32, smem, stream>>>(p, values, offsets, weights, group_lanes, tile_bags);
}

template <typename index_t>
void launch_index_dist(const RwParams& p, const index_t* values, const int64_t* offsets,
                       const float* weights, cudaStream_t stream) {
  if (p.trace) {
    p.id_bytes == 4 ? launch_index_dist<index_t, int32_t, true>(p, values, offsets, weights, stream)
                    : launch_index_dist<index_t, int64_t, true>(p, values, offsets, weights, stream);
  } else {
    p.id_bytes == 4 ? launch_index_dist<index_t, int32_t, false>(p, values, offsets, weights, stream)
                    : launch_index_dist<index_t, int64_t, false>(p, values, offsets, weights, stream);
  }
}

}  // namespace

RwParams make_rw_params(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                        const at::Tensor& features, const at::Tensor& state,
                        const at::Tensor& bag_div, const at::Tensor& status,
                        at::IntArrayRef cfg, int64_t batch, int64_t nnz);

void check_dist_inputs(const at::Tensor& values, const at::Tensor& offsets,
                       const c10::optional<at::Tensor>& weights, const RwParams& p) {
  TORCH_CHECK(values.is_cuda() && offsets.is_cuda() && offsets.scalar_type() == at::kLong,
              "pgas index dist: CUDA values and int64 offsets expected");
  TORCH_CHECK(values.scalar_type() == at::kLong || values.scalar_type() == at::kInt,
              "pgas index dist: int32 or int64 ids expected");
  TORCH_CHECK(offsets.numel() == p.num_features * p.batch + 1, "pgas index dist: offsets must hold F*B+1");
  TORCH_CHECK(!weights.has_value() || (weights->is_cuda() && weights->scalar_type() == at::kFloat &&
                                       weights->numel() == values.numel()),
              "pgas index dist: weights must be float32 CUDA, one per id");
  TORCH_CHECK(p.weighted == (weights.has_value() ? 1 : 0), "pgas index dist: weighted mismatch");
}

void rw_index_dist(const at::Tensor& values, const at::Tensor& offsets,
                   const c10::optional<at::Tensor>& weights, const at::Tensor& buf,
                   const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                   const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                   at::IntArrayRef cfg, int64_t batch) {
  const RwParams p = make_rw_params(buf, pad, peers, features, state, bag_div, status, cfg, batch,
                                    values.numel());
  check_dist_inputs(values, offsets, weights, p);
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  if (values.scalar_type() == at::kLong) {
    launch_index_dist(p, values.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), w, stream);
  } else {
    launch_index_dist(p, values.data_ptr<int32_t>(), offsets.data_ptr<int64_t>(), w, stream);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
