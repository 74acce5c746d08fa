// pgas_row_wise stage 1 (requester): bucketize + scatter ids straight into the owners.
//
// Layout written: this rank's index block [slot][src = rank] in every owner's
// buffer (see rw_pipeline.cuh). Bag fb keeps the requester's CSR span
// [offsets[fb], offsets[fb+1]); the ids that owner d holds are packed at the
// start of that span in d's copy, and lengths[fb] says how many. So no scan
// across bags is needed: one warp per bag groups its ids by owner with
// __match_any_sync and stores each straight into the owner's buffer through its
// NVLink peer pointer.
//
// Bounds: an id outside [0, N) never produces a remote write. FATAL drops it and
// records kErrBadId (raised on the host); WARNING/IGNORE read row 0 instead
// (id := 0, as FBGEMM does), WARNING also records kErrBadIdWarn.
//
// Completion: fence + done counter; the last CTA writes the header, the final
// offset and the epoch into every owner's index slot, then advances the stage
// epoch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "rw_pipeline.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kWarps = 8;

template <typename index_t>
__global__ void __launch_bounds__(kWarps * 32)
    rw_index_dist_kernel(RwParams p, const index_t* __restrict__ values,
                         const int64_t* __restrict__ offsets, const float* __restrict__ weights) {
  __shared__ int32_t s_count[kWarps][kMaxWorld];
  __shared__ int64_t s_epoch;
  if (threadIdx.x == 0) s_epoch = p.state[kCtrIndex] + 1;
  __syncthreads();
  const int64_t epoch = s_epoch;
  const int64_t slot = epoch % p.num_slots;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1;
  const int64_t num_bags = p.num_features * p.batch;
  const int64_t my_block = index_block(p, slot, p.rank);
  float* bag_div = p.bag_div + slot * p.num_features * p.max_batch;

  for (int64_t bag = static_cast<int64_t>(blockIdx.x) * kWarps + warp; bag < num_bags;
       bag += static_cast<int64_t>(gridDim.x) * kWarps) {
    const RwFeature& feat = p.features[bag / p.batch];
    int64_t begin = offsets[bag];
    int64_t end = offsets[bag + 1];
    // The local KJT's offsets decide addresses in the owners' buffers.
    if (begin < 0 || end < begin || end > p.nnz) {
      if (lane == 0) record_error(p, kErrCorrupt, p.rank, 1);
      begin = end = 0;
    }
    for (int d = lane; d < p.world; d += 32) s_count[warp][d] = 0;
    __syncwarp();
    float divisor = 0.f;  // bag length, or the sum of its weights
    for (int64_t j0 = begin; j0 < end; j0 += 32) {
      const int64_t j = j0 + lane;
      int owner = -1;
      int64_t row = 0;
      float w = 1.f;
      if (j < end) {
        int64_t id = static_cast<int64_t>(values[j]);
        if (weights != nullptr) w = weights[j];
        divisor += w;
        if (id < 0 || id >= feat.hash_size) {
          const int64_t f = bag / p.batch;
          if (p.bounds_mode == kBoundsFatal) {
            record_error(p, kErrBadId, f, id);
            id = -1;
          } else {
            if (p.bounds_mode == kBoundsWarning) record_error(p, kErrBadIdWarn, f, id);
            id = 0;
          }
        }
        if (id >= 0) {
          owner = static_cast<int>(id / feat.block);
          row = id - owner * feat.block;
        }
      }
      // Lanes with the same owner form one group; each takes the next free
      // position of that owner's part of the bag.
      const unsigned group = __match_any_sync(0xffffffffu, owner);
      const int base = owner >= 0 ? s_count[warp][owner] : 0;
      __syncwarp();
      if (owner >= 0) {
        const int64_t pos = begin + base + __popc(group & lanes_below);
        uint8_t* dst = reinterpret_cast<uint8_t*>(p.peer_bufs[owner]) + my_block;
        reinterpret_cast<int64_t*>(dst + p.ids_off)[pos] = row;
        if (weights != nullptr) reinterpret_cast<float*>(dst + p.weights_off)[pos] = w;
        if ((group & lanes_below) == 0) s_count[warp][owner] = base + __popc(group);
      }
      __syncwarp();
    }
    for (int d = lane; d < p.world; d += 32) {
      uint8_t* dst = reinterpret_cast<uint8_t*>(p.peer_bufs[d]) + my_block;
      reinterpret_cast<int32_t*>(dst + p.lengths_off)[bag] = s_count[warp][d];
      reinterpret_cast<int64_t*>(dst + p.offsets_off)[bag] = begin;
    }
    for (int o = 16; o > 0; o /= 2) divisor += __shfl_xor_sync(0xffffffffu, divisor, o);
    if (lane == 0) bag_div[bag] = divisor;
    __syncwarp();
  }

  __syncthreads();
  if (threadIdx.x == 0 && last_to_arrive(p.state + kDoneIndex, gridDim.x)) {
    for (int d = 0; d < p.world; ++d) {
      uint8_t* dst = reinterpret_cast<uint8_t*>(p.peer_bufs[d]) + my_block;
      int64_t* header = reinterpret_cast<int64_t*>(dst);
      header[0] = epoch;
      header[1] = p.batch;
      header[2] = p.nnz;
      header[3] = 0;
      reinterpret_cast<int64_t*>(dst + p.offsets_off)[num_bags] = p.nnz;
    }
    __threadfence_system();
    for (int d = 0; d < p.world; ++d) {
      int64_t* peer_pad = reinterpret_cast<int64_t*>(p.peer_pads[d]);
      st_release_sys(peer_pad + kPadHeaderWords + p.rank, epoch);
    }
    p.state[kCtrIndex] = epoch;
  }
}

}  // namespace

RwParams make_rw_params(const at::Tensor& buf, const at::Tensor& pad, const at::Tensor& peers,
                        const at::Tensor& features, const at::Tensor& state,
                        const at::Tensor& bag_div, const at::Tensor& status,
                        at::IntArrayRef cfg, int64_t batch, int64_t nnz);

void rw_index_dist(const at::Tensor& values, const at::Tensor& offsets,
                   const c10::optional<at::Tensor>& weights, const at::Tensor& buf,
                   const at::Tensor& pad, const at::Tensor& peers, const at::Tensor& features,
                   const at::Tensor& state, const at::Tensor& bag_div, const at::Tensor& status,
                   at::IntArrayRef cfg, int64_t batch) {
  TORCH_CHECK(values.is_cuda() && offsets.is_cuda() && offsets.scalar_type() == at::kLong,
              "rw_index_dist: CUDA values and int64 offsets expected");
  const RwParams p = make_rw_params(buf, pad, peers, features, state, bag_div, status, cfg, batch,
                                    values.numel());
  TORCH_CHECK(offsets.numel() == p.num_features * batch + 1, "rw_index_dist: offsets must hold F*B+1");
  TORCH_CHECK(!weights.has_value() || (weights->is_cuda() && weights->scalar_type() == at::kFloat &&
                                       weights->numel() == values.numel()),
              "rw_index_dist: weights must be float32 CUDA, one per id");
  TORCH_CHECK(p.weighted == (weights.has_value() ? 1 : 0), "rw_index_dist: weighted mismatch");
  const int64_t num_bags = p.num_features * batch;
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((num_bags + kWarps - 1) / kWarps, 4096)));
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  if (values.scalar_type() == at::kLong) {
    rw_index_dist_kernel<int64_t><<<grid, kWarps * 32, 0, stream>>>(
        p, values.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), w);
  } else {
    TORCH_CHECK(values.scalar_type() == at::kInt, "rw_index_dist: int32 or int64 ids expected");
    rw_index_dist_kernel<int32_t><<<grid, kWarps * 32, 0, stream>>>(
        p, values.data_ptr<int32_t>(), offsets.data_ptr<int64_t>(), w);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
