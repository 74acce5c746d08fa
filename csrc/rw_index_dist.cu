// pgas_row_wise stage 1 (requester): bucketize + scatter ids straight into the owners.
//
// Layout written: this rank's index block [slot][src = rank] in every owner's
// buffer (see rw_pipeline.cuh). Bag fb keeps the requester's CSR span
// [offsets[fb], offsets[fb+1]); the ids that owner d holds are packed at the
// start of that span in d's copy, as row_t local rows, and lengths[fb] says how
// many. So no scan across bags is needed: a group of G lanes (G = the mean bag
// length rounded up to a power of two in [4, 32], chosen on the host) takes one
// bag, G ids at a time (the next chunk prefetched); __match_any_sync over the
// warp on the key (group, owner) ranks each id among the group's ids of the
// same owner, a per-(group, owner) count in shared memory carries the rank
// across chunks, and each id is stored straight into its owner's buffer
// through the NVLink peer pointer (lanes of one owner store consecutive slots).
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
constexpr int kMaxGroups = 8;  // G >= 4

// One chunk of a bag: lane g's id (position at + g) and weight, if g < left.
template <typename index_t>
__device__ __forceinline__ void load_chunk(const index_t* values, const float* weights, int64_t at,
                                           int64_t left, int g_lane, int64_t& id, float& w) {
  id = 0;
  w = 1.f;
  if (g_lane < left) {
    id = static_cast<int64_t>(values[at + g_lane]);
    if (weights != nullptr) w = weights[at + g_lane];
  }
}

template <typename index_t, typename row_t>
__global__ void __launch_bounds__(kWarps * 32, 4)
    rw_index_dist_kernel(RwParams p, const index_t* __restrict__ values,
                         const int64_t* __restrict__ offsets, const float* __restrict__ weights,
                         int group_lanes) {
  __shared__ int32_t s_count[kWarps][kMaxGroups][kMaxWorld];
  __shared__ int64_t s_epoch;
  if (threadIdx.x == 0) s_epoch = p.state[kCtrIndex] + 1;
  __syncthreads();
  const int64_t epoch = s_epoch;
  const int64_t slot = epoch % p.num_slots;
  const int G = group_lanes;
  const int groups_per_warp = 32 / G;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = lane / G;
  const int g_lane = lane % G;
  const unsigned lanes_below = (1u << lane) - 1;
  int32_t* count = s_count[warp][group];
  const int64_t num_bags = p.num_features * p.batch;
  const int64_t my_block = index_block(p, slot, p.rank);
  float* bag_div = p.bag_div + slot * p.num_features * p.max_batch;

  // Warp-uniform loop: the warp's groups take consecutive bags.
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * groups_per_warp;
       first < num_bags; first += static_cast<int64_t>(gridDim.x) * kWarps * groups_per_warp) {
    const int64_t bag = first + group;
    const bool valid = bag < num_bags;
    const int64_t f = valid ? bag / p.batch : 0;
    const RwFeature& feat = p.features[f];
    int64_t begin = valid ? offsets[bag] : 0;
    int64_t end = valid ? offsets[bag + 1] : 0;
    // The local KJT's offsets decide addresses in the owners' buffers.
    if (begin < 0 || end < begin || end > p.nnz || end - begin > INT32_MAX) {
      if (g_lane == 0) record_error(p, kErrCorrupt, p.rank, 1);
      begin = end = 0;
    }
    const int n = static_cast<int>(end - begin);
    for (int d = g_lane; d < p.world; d += G) count[d] = 0;
    __syncwarp();
    float divisor = 0.f;  // bag length, or the sum of its weights
    const int longest = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(n));
    int64_t next_id;
    float next_w;
    load_chunk(values, weights, begin, n, g_lane, next_id, next_w);
    for (int j0 = 0; j0 < longest; j0 += G) {
      int64_t id = next_id;
      float w = next_w;
      const bool live = j0 + g_lane < n;
      if (j0 + G < n) load_chunk(values, weights, begin + j0 + G, n - j0 - G, g_lane, next_id, next_w);
      int owner = -1;
      int64_t row = 0;
      if (live) {
        divisor += w;
        if (id < 0 || id >= feat.hash_size) {
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
      // Lanes of one group with the same owner match; idle lanes match nobody.
      const int key = owner >= 0 ? group * kMaxWorld + owner : -1 - lane;
      const unsigned same = __match_any_sync(0xffffffffu, key);
      const int base = owner >= 0 ? count[owner] : 0;
      __syncwarp();
      if (owner >= 0) {
        const int64_t pos = begin + base + __popc(same & lanes_below);
        uint8_t* dst = reinterpret_cast<uint8_t*>(p.peer_bufs[owner]) + my_block;
        reinterpret_cast<row_t*>(dst + p.ids_off)[pos] = static_cast<row_t>(row);
        if (weights != nullptr) reinterpret_cast<float*>(dst + p.weights_off)[pos] = w;
        if ((same & lanes_below) == 0) count[owner] = base + __popc(same);
      }
      __syncwarp();
    }
    if (valid) {
      for (int d = g_lane; d < p.world; d += G) {
        uint8_t* dst = reinterpret_cast<uint8_t*>(p.peer_bufs[d]) + my_block;
        reinterpret_cast<int32_t*>(dst + p.lengths_off)[bag] = count[d];
        reinterpret_cast<int64_t*>(dst + p.offsets_off)[bag] = begin;
      }
    }
    for (int o = G / 2; o > 0; o /= 2) divisor += __shfl_xor_sync(0xffffffffu, divisor, o);
    if (valid && g_lane == 0) bag_div[bag] = divisor;
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

template <typename index_t, typename row_t>
void launch_index_dist(const RwParams& p, const index_t* values, const int64_t* offsets,
                       const float* weights, cudaStream_t stream) {
  const int64_t num_bags = p.num_features * p.batch;
  int group_lanes = 4;
  while (group_lanes < 32 && group_lanes * num_bags < p.nnz) group_lanes *= 2;
  const int64_t bags_per_cta = kWarps * (32 / group_lanes);
  static const int resident = resident_ctas(rw_index_dist_kernel<index_t, row_t>, kWarps * 32);
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((num_bags + bags_per_cta - 1) / bags_per_cta, resident)));
  rw_index_dist_kernel<index_t, row_t><<<grid, kWarps * 32, 0, stream>>>(p, values, offsets, weights,
                                                                          group_lanes);
}

template <typename index_t>
void launch_index_dist(const RwParams& p, const index_t* values, const int64_t* offsets,
                       const float* weights, cudaStream_t stream) {
  if (p.id_bytes == 4) {
    launch_index_dist<index_t, int32_t>(p, values, offsets, weights, stream);
  } else {
    launch_index_dist<index_t, int64_t>(p, values, offsets, weights, stream);
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
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  if (values.scalar_type() == at::kLong) {
    launch_index_dist(p, values.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), w, stream);
  } else {
    TORCH_CHECK(values.scalar_type() == at::kInt, "rw_index_dist: int32 or int64 ids expected");
    launch_index_dist(p, values.data_ptr<int32_t>(), offsets.data_ptr<int64_t>(), w, stream);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
