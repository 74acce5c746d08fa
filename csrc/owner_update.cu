// The owner update on the GPU: owner_update.h's run list and two phases, four
// kernels on one stream, no host sync (the id count is the launch's n or a
// device word; the hyper-parameters are read on the device).
//
// The run list (owner_run_counts, a scan, owner_run_scatter): CTA c takes a
// contiguous range of whole tiles of the used positions (counted_sort's split:
// a fixed grid, each CTA reading how many positions are used), counts the run
// starts in it, and after an exclusive scan of the counts writes each start's
// position at its rank, in position order; CTA 0 then writes the count and
// ends the list with `used`. Phase 1 (owner_sum_kernel) and phase 2
// (owner_combine_kernel) give each item (a block's head piece or a run; a
// block) to a group of kLanes lanes of a warp, grid-stride over the items;
// every branch of an item is uniform over its group, and a group's shuffles
// and syncs name its lanes only (the groups of a warp diverge). Phase 1's
// groups read their runs' fields kLanes runs at a time, a run a lane. Each kernel
// starts after the previous one's grid completes (stream order): the list and
// the partials it reads are written.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "counted_sort.cuh"
#include "owner_update.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;
using counted_sort::kTile;  // positions a list CTA takes at a time: kThreads threads of kListItems
constexpr int kListItems = kTile / kThreads;

// Run starts among this CTA's positions.
__global__ void __launch_bounds__(kThreads) owner_run_counts(OwnerUpdateParams p, int32_t* counts) {
  using Reduce = cub::BlockReduce<int32_t, kThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  const counted_sort::Range r = counted_sort::cta_range(used_positions(p));
  int32_t mine = 0;
  for (int64_t q = r.lo + threadIdx.x; q < r.hi; q += kThreads) mine += starts_run(p, q) ? 1 : 0;
  const int32_t total = Reduce(reduce).Sum(mine);
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

// The run starts' positions, CTA c's from first[c] on: thread t of a tile takes its kListItems adjacent
// positions, ranked by a block scan of the threads' counts (position order).
__global__ void __launch_bounds__(kThreads) owner_run_scatter(OwnerUpdateParams p, const int32_t* first,
                                                              const int32_t* counts, int32_t* run_begin,
                                                              int64_t* runs) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int64_t used = used_positions(p);
  const counted_sort::Range r = counted_sort::cta_range(used);
  int64_t next = first[blockIdx.x];
  for (int64_t lo = r.lo; lo < r.hi; lo += kTile) {
    const int64_t q0 = lo + static_cast<int64_t>(threadIdx.x) * kListItems;
    bool start[kListItems];
    int32_t count = 0;
#pragma unroll
    for (int k = 0; k < kListItems; ++k) {
      start[k] = q0 + k < r.hi && starts_run(p, q0 + k);
      count += start[k] ? 1 : 0;
    }
    int32_t rank = 0, total = 0;
    Scan(scan).ExclusiveSum(count, rank, total);
#pragma unroll
    for (int k = 0; k < kListItems; ++k) {
      if (start[k]) run_begin[next + rank++] = static_cast<int32_t>(q0 + k);
    }
    next += total;
    __syncthreads();  // the scan's storage is read before the next tile's scan reuses it
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int64_t listed = first[gridDim.x - 1] + counts[gridDim.x - 1];
    *runs = listed;
    run_begin[listed] = static_cast<int32_t>(used);
  }
}

// kLanes lanes of a warp as a group: kColumns columns a lane (dim <= kLanes * kColumns, sized by the widest
// table of the launch), kDepth ids' gradient rows in flight, kMinBlocks CTAs an SM: at dim <= 128, 3 (about 80
// registers, nothing spilled: ptxas, nvcc 13.0, sm_90a), where 4 spilled ~90 bytes and measured 20% slower on
// uniform ids (benchmarks/NOTES.md item 2).
template <int kGroupLanes, int kGroupColumns>
struct WarpGroup {
  static constexpr int kLanes = kGroupLanes;
  static constexpr int kColumns = kGroupColumns;
  static constexpr int kDepth = kColumns <= 4 ? 2 : 1;
  static constexpr int kMinBlocks = kColumns <= 4 ? 3 : 1;
  static_assert(32 % kLanes == 0 && kColumns % 4 == 0, "groups tile a warp; four adjacent columns a lane");
  int lane;
  unsigned mask;  // the group's lanes in its warp
  __device__ static WarpGroup of_thread() {
    const int warp_lane = static_cast<int>(threadIdx.x % 32);
    return {warp_lane % kLanes, kLanes == 32 ? ~0u : ((1u << kLanes) - 1u) << (warp_lane / kLanes * kLanes)};
  }
  __device__ constexpr int columns(int) const { return kColumns; }  // unrolled; column_of < dim guards
  __device__ IdTerm broadcast(const IdTerm& m, int from, const OwnerUpdateConfig& c) const {
    return {__shfl_sync(mask, m.src, from, kLanes), c.weighted ? __shfl_sync(mask, m.weight, from, kLanes) : 1.f,
            c.mean ? __shfl_sync(mask, m.inv_length, from, kLanes) : 1.f};
  }
  __device__ float sum(float x) const {
    for (int o = kLanes / 2; o > 0; o >>= 1) x += __shfl_xor_sync(mask, x, o, kLanes);
    return x;
  }
  __device__ void sync() const { __syncwarp(mask); }
};

// Items [0, items) taken grid-stride by the groups.
template <typename Group, typename Item>
__device__ __forceinline__ void for_each_group_item(int64_t items, Group group, Item&& item) {
  const int64_t groups = static_cast<int64_t>(gridDim.x) * (kThreads / Group::kLanes);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / Group::kLanes; i < items;
       i += groups) {
    item(i);
  }
}

// Phase 1: the blocks' head pieces (a group a block), then the runs: a group takes kLanes runs at a time
// (grid-stride), reads their RunMeta one a lane (the list, keys, rows and first ids' terms of kLanes runs
// loaded together, not one run's after another's), stages them in its slots of shared memory and sums them
// in turn. The groups of a warp never wait for each other: a group's runs may hold 1 id or 256.
template <typename weight_t, typename grad_t, Optimizer kOptimizer, typename Group>
__global__ void __launch_bounds__(kThreads, Group::kMinBlocks) owner_sum_kernel(OwnerUpdateParams p) {
  if (p.apply != nullptr && *p.apply == 0) return;  // a refused step: every group reads the word first
  __shared__ RunMeta staged[kThreads];
  const int64_t used = used_positions(p), blocks = blocks_of(used), runs = *p.runs;
  const Group group = Group::of_thread();
  for_each_group_item(blocks, group, [&](int64_t k) { sum_block_head<Group, grad_t>(p, k, used, group); });
  RunMeta* slots = staged + threadIdx.x / Group::kLanes * Group::kLanes;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * (kThreads / Group::kLanes);
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / Group::kLanes * Group::kLanes;
       r0 < runs; r0 += groups * Group::kLanes) {
    const RunMeta mine = r0 + group.lane < runs ? run_meta(p, r0 + group.lane)
                                                : RunMeta{{-1, 0.f, 0.f}, 0, 0, {-1, 0}};
    group.sync();  // the group's last batch is read
    slots[group.lane] = mine;
    group.sync();
    const int count = runs - r0 < Group::kLanes ? static_cast<int>(runs - r0) : Group::kLanes;
    for (int j = 0; j < count; ++j) sum_run<Group, weight_t, grad_t, kOptimizer>(p, slots[j], group);
  }
}

template <typename weight_t, Optimizer kOptimizer, typename Group>
__global__ void __launch_bounds__(kThreads, Group::kMinBlocks) owner_combine_kernel(OwnerUpdateParams p) {
  if (p.apply != nullptr && *p.apply == 0) return;
  const int64_t used = used_positions(p);
  const Group group = Group::of_thread();
  for_each_group_item(blocks_of(used), group,
                      [&](int64_t k) { combine_run<Group, weight_t, kOptimizer>(p, k, used, group); });
}

// The run list of the positions `used` counts (of n), from `scratch`.
void list_runs(OwnerUpdateParams& p, const std::function<void*(size_t)>& scratch, cudaStream_t stream) {
  PGAS_CHECK(p.n < (int64_t{1} << 31) - 1, "owner_update: %lld positions exceed int32 run starts",
             static_cast<long long>(p.n));
  const int ctas = counted_sort::grid_ctas(p.n);
  int32_t* counts = static_cast<int32_t*>(scratch(2 * static_cast<size_t>(ctas) * sizeof(int32_t)));
  int32_t* first = counts + ctas;
  int32_t* run_begin = static_cast<int32_t*>(scratch(static_cast<size_t>(p.n + 1) * sizeof(int32_t)));
  int64_t* runs = static_cast<int64_t*>(scratch(sizeof(int64_t)));
  size_t temp_bytes = 0;
  PGAS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, counts, first, ctas, stream));
  void* temp = scratch(std::max<size_t>(temp_bytes, 1));
  owner_run_counts<<<ctas, kThreads, 0, stream>>>(p, counts);
  PGAS_CUDA_CHECK(cudaGetLastError());
  PGAS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, first, ctas, stream));
  owner_run_scatter<<<ctas, kThreads, 0, stream>>>(p, first, counts, run_begin, runs);
  PGAS_CUDA_CHECK(cudaGetLastError());
  p.run_begin = run_begin;
  p.runs = runs;
}

// `items` over resident CTAs at most, as many as fill with one item a group.
template <typename Kernel>
int grid_for(Kernel kernel, int64_t items, int lanes) {
  const int64_t needed = (items + kThreads / lanes - 1) / (kThreads / lanes);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, resident_ctas(kernel, kThreads))));
}

template <typename weight_t, typename grad_t, Optimizer kOptimizer, typename Group>
void launch(OwnerUpdateParams p, int64_t max_dim, const std::function<void*(size_t)>& scratch,
            cudaStream_t stream) {
  list_runs(p, scratch, stream);
  const int64_t cols = (max_dim + 31) / 32 * 32;
  p.partial_stride = 2 * cols + 1;
  p.partials = static_cast<float*>(scratch(static_cast<size_t>(2 * blocks_of(p.n) * p.partial_stride) * sizeof(float)));
  const auto sum = owner_sum_kernel<weight_t, grad_t, kOptimizer, Group>;
  const auto combine = owner_combine_kernel<weight_t, kOptimizer, Group>;
  sum<<<grid_for(sum, p.n, Group::kLanes), kThreads, 0, stream>>>(p);
  PGAS_CUDA_CHECK(cudaGetLastError());
  combine<<<grid_for(combine, blocks_of(p.n), Group::kLanes), kThreads, 0, stream>>>(p);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_owner_update(OwnerUpdateParams p, c10::ScalarType grad, c10::ScalarType weights, int64_t max_dim,
                         const std::function<void*(size_t)>& scratch, cudaStream_t stream) {
  dispatch_owner_update(grad, weights, p.config.optimizer, [&](auto weight, auto grad_type, auto optimizer) {
    if (p.n == 0) return;
    using weight_t = decltype(weight);
    using grad_t = decltype(grad_type);
    constexpr Optimizer kOptimizer = decltype(optimizer)::value;
    if (max_dim <= 32) {  // four columns a lane: a dim-64 row is 16 lanes' 16-byte vectors
      launch<weight_t, grad_t, kOptimizer, WarpGroup<8, 4>>(p, max_dim, scratch, stream);
    } else if (max_dim <= 64) {
      launch<weight_t, grad_t, kOptimizer, WarpGroup<16, 4>>(p, max_dim, scratch, stream);
    } else if (max_dim <= 128) {
      launch<weight_t, grad_t, kOptimizer, WarpGroup<32, 4>>(p, max_dim, scratch, stream);
    } else {
      launch<weight_t, grad_t, kOptimizer, WarpGroup<32, kOwnerMaxDim / 32>>(p, max_dim, scratch, stream);
    }
  });
}

}  // namespace torchrec_pgas
