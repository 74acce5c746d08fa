// The owner update on the GPU: the two phases of owner_update.h, a kernel
// each, with a warp per chunk of sorted positions (a warp's first chunk by its
// index, then the next not yet taken, from a counter a phase; their size set by
// the used positions and the resident warps). The
// warp's lanes read a batch of 32 positions' fields one a lane, then walk the
// positions together, splitting each row's columns. Phase 2 starts after
// phase 1's grid completes (stream order): the partials it reads are written.
// No host sync: the id count is the launch's n (or a device word), the
// hyper-parameters are read on the device.
#include <algorithm>

#include "owner_update.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kCounterFloats = 4;  // the two chunk counters ahead of the partials

// A warp as the walk's lanes: kColumns columns a lane (dim <= 32 * kColumns,
// sized by the widest table of the launch), and as many ids' rows in flight
// (kDepth) as registers allow at kMinBlocks CTAs per SM. Chosen by measurement
// (benchmarks/archive/NOTES-2026-11.md.gz §33, §35; benchmarks/NOTES.md, 2026-12-02): up to dim 64, 4 CTAs
// at 64 registers, where ptxas (nvcc 13.0, sm_90a, -Xptxas -v) spills up to 32 bytes in some
// instantiations, beat 3 CTAs without spills and 5 at 48 registers; wider rows spill nothing.
template <int kColumns>
struct WarpLanes {
  static constexpr int kCount = 32;
  static constexpr int kMaxColumns = kColumns;
  static constexpr int kDepth = kColumns == 1 ? 3 : kColumns == 2 ? 2 : kColumns <= 4 ? 2 : 1;
  static constexpr int kMinBlocks = kColumns <= 2 ? 4 : kColumns <= 4 ? 2 : 1;
  int lane;
  IdMeta* slots;  // the warp's 32 staged positions, in shared memory
  __device__ constexpr int columns(int) const { return kColumns; }  // unrolled; d < dim guards
  __device__ float sum(float x) const {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
  }
  __device__ unsigned ballot(bool flag) const { return __ballot_sync(0xffffffffu, flag); }
  __device__ int first(unsigned mask) const { return __ffs(mask) - 1; }
  // After every lane's reads of the previous batch's slots; then visible to the warp.
  __device__ void stage(const IdMeta& m) const {
    __syncwarp();
    slots[lane] = m;
    __syncwarp();
  }
  __device__ IdMeta staged(int i) const { return slots[i]; }
  __device__ void sync() const { __syncwarp(); }
};

// The walkers' loop over the chunks of the used positions: a warp's first chunk is its index in the grid; its next
// one, with a counter `next`, the first not yet taken, asked for as it finishes a chunk (the counter counts takes
// past the first chunks), else the next of a grid stride. A chunk's cost follows its runs: a chunk inside a hot
// row's run only sums its ids, one of single-id runs applies a row an id. A fixed assignment lines up with the
// sorted layout (tables whose ids are alike repeat their hot rows' positions every table, so a grid stride hands
// some warps every table's cheap chunks and others every costly one); warps that take the next chunk as they
// finish one stay even. With no more chunks than warps (small steps) every chunk is a first chunk, all start at
// once and no warp asks the counter. The chunks, and so every sum, follow from the used positions and the
// resident warps alone (an eager launch and a captured one cut the same chunks): which warp walks a chunk changes
// nothing.
template <int kColumns, typename Walk>
__device__ __forceinline__ void for_each_chunk(const OwnerUpdateParams& p, unsigned long long* next, Walk&& walk) {
  if (p.apply != nullptr && *p.apply == 0) return;  // a refused step: every walker reads the word first
  __shared__ IdMeta slots[kWarps][32];
  const WarpLanes<kColumns> lanes{static_cast<int>(threadIdx.x % 32), slots[threadIdx.x / 32]};
  const int64_t used = used_positions(p), size = chunk_positions(used, p.walkers);
  const auto chunks = static_cast<unsigned long long>((used + size - 1) / size);
  const auto warps = static_cast<unsigned long long>(gridDim.x) * kWarps;
  const auto after = [&](unsigned long long c) {
    if (next == nullptr || chunks <= warps) return c + warps;
    unsigned long long taken = 0;
    if (lanes.lane == 0) taken = atomicAdd(next, 1ull);
    return warps + __shfl_sync(0xffffffffu, taken, 0);
  };
  for (auto c = static_cast<unsigned long long>(blockIdx.x) * kWarps + threadIdx.x / 32; c < chunks; c = after(c)) {
    walk(static_cast<int64_t>(c), size, used, lanes);
  }
}

template <typename weight_t, typename grad_t, Optimizer kOptimizer, int kColumns>
__global__ void __launch_bounds__(kThreads, WarpLanes<kColumns>::kMinBlocks)
    owner_walk_kernel(OwnerUpdateParams p, unsigned long long* next) {
  for_each_chunk<kColumns>(p, next, [&](int64_t c, int64_t size, int64_t used, WarpLanes<kColumns> lanes) {
    walk_chunk<WarpLanes<kColumns>, weight_t, grad_t, kOptimizer>(p, c, size, used, lanes);
  });
}

// Phase 2 sums no id: one kernel for every gradient dtype.
template <typename weight_t, Optimizer kOptimizer, int kColumns>
__global__ void __launch_bounds__(kThreads, WarpLanes<kColumns>::kMinBlocks)
    owner_finish_kernel(OwnerUpdateParams p, unsigned long long* next) {
  for_each_chunk<kColumns>(p, next, [&](int64_t c, int64_t size, int64_t used, WarpLanes<kColumns> lanes) {
    finish_run<WarpLanes<kColumns>, weight_t, kOptimizer>(p, c, size, used, lanes);
  });
}

// Both phases on `stream`, as many CTAs as the positions fill with 32-id chunks, at most the resident ones (a
// captured step's capacity: every resident CTA, each reading how many positions are used).
template <typename weight_t, typename grad_t, Optimizer kOptimizer, int kColumns>
void launch(OwnerUpdateParams p, int64_t max_dim, const std::function<float*(int64_t)>& alloc_partials,
            cudaStream_t stream) {
  const auto walk = owner_walk_kernel<weight_t, grad_t, kOptimizer, kColumns>;
  const int resident = resident_ctas(walk, kThreads);
  p.walkers = static_cast<int64_t>(resident) * kWarps;
  const int64_t cols = (max_dim + 31) / 32 * 32;
  p.partial_stride = 2 * cols + 1;
  // The phases' chunk counters (8 bytes each, zeroed in stream order), then the partials.
  float* buffer = alloc_partials(kCounterFloats + 2 * max_chunks(p.n, p.walkers) * p.partial_stride);
  PGAS_CHECK(reinterpret_cast<uintptr_t>(buffer) % alignof(unsigned long long) == 0,
             "owner_update: the partials' buffer is not 8-byte aligned");
  auto* next = reinterpret_cast<unsigned long long*>(buffer);
  PGAS_CUDA_CHECK(cudaMemsetAsync(next, 0, 2 * sizeof(unsigned long long), stream));
  p.partials = buffer + kCounterFloats;
  const int64_t needed = (p.n + kWarps * 32 - 1) / (kWarps * 32);
  const int blocks = static_cast<int>(std::min<int64_t>(needed, resident));
  walk<<<blocks, kThreads, 0, stream>>>(p, next);
  PGAS_CUDA_CHECK(cudaGetLastError());
  owner_finish_kernel<weight_t, kOptimizer, kColumns><<<blocks, kThreads, 0, stream>>>(p, next + 1);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_owner_update(OwnerUpdateParams p, c10::ScalarType grad, c10::ScalarType weights, int64_t max_dim,
                         const std::function<float*(int64_t)>& alloc_partials, cudaStream_t stream) {
  dispatch_owner_update(grad, weights, p.config.optimizer, [&](auto weight, auto grad_type, auto optimizer) {
    if (p.n == 0) return;
    using weight_t = decltype(weight);
    using grad_t = decltype(grad_type);
    constexpr Optimizer kOptimizer = decltype(optimizer)::value;
    if (max_dim <= 32) {
      launch<weight_t, grad_t, kOptimizer, 1>(p, max_dim, alloc_partials, stream);
    } else if (max_dim <= 64) {
      launch<weight_t, grad_t, kOptimizer, 2>(p, max_dim, alloc_partials, stream);
    } else if (max_dim <= 128) {
      launch<weight_t, grad_t, kOptimizer, 4>(p, max_dim, alloc_partials, stream);
    } else {
      launch<weight_t, grad_t, kOptimizer, kOwnerMaxDim / 32>(p, max_dim, alloc_partials, stream);
    }
  });
}

}  // namespace torchrec_pgas
