// A stable LSD radix sort of (key, value) pairs whose item count is a word
// on the device: the first *count of `capacity` positions are sorted, and
// no kernel touches a position past them. An eager step and a captured one
// then sort only the ids they hold, with no host read of the count and
// fixed shapes for a capture (the capacity stays a maximum).
//
// Each 8-bit digit pass is two kernels over a fixed grid of `ctas` CTAs
// (a few per SM, at most one tile each when the capacity is small), with
// CUB's device scan between them:
//   1. digit_counts: CTA c takes items [lo_c, hi_c), a contiguous range of
//      whole tiles (the same split of the count in both kernels), and writes
//      how many of them hold each digit to counts[digit * ctas + c]
//      (digit-major, so one exclusive scan gives every (digit, CTA) pair its
//      first output position: the digits in order, and inside a digit the
//      CTAs in the order of their ranges);
//   2. scatter: CTA c walks its range a tile (kTile items) at a time, loads
//      it warp-striped (warp w's lane l holds items w * 32 * kItems + 32 k +
//      l: coalesced), ranks the keys by the digit with
//      cub::BlockRadixRankMatch (its ranks follow the digit, then the warp,
//      item and lane: the tile's order), exchanges the tile through shared
//      memory in rank order, and writes item j of digit d to next[d] + (j -
//      first rank of d), then advances next[d] by the tile's count of d.
// Ranges, tiles and ranks all keep input order, so the pass is stable, and
// the passes (least significant digit first) sort by the whole key.
// Positions past the count in a tile are loaded as all-ones keys: they rank
// after every item (digit 255, last in the tile) and are never written.
//
// Synchronization: the kernels of a pass and the passes are ordered on one
// stream; inside scatter, __syncthreads separates the rank's shared storage
// from the exchange that reuses it, and the exchange from the next tile.
#pragma once

#include <cub/block/block_load.cuh>
#include <cub/block/block_radix_rank.cuh>
#include <cub/block/radix_rank_sort_operations.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <functional>

#include "pgas_check.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace counted_sort {

constexpr int kThreads = 256;
constexpr int kDigitBits = 8;
constexpr int kDigits = 1 << kDigitBits;  // == kThreads: thread t owns digit t's counters
constexpr int kItems = 8;  // a thread's keys in a tile (warp-striped)
constexpr int kTile = kThreads * kItems;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // keys a thread reads before it counts them (digit_counts)
static_assert(kDigits == kThreads, "each thread owns one digit's counters");

// The items to sort: *count clamped to [0, capacity] (the whole capacity without a count word).
__device__ __forceinline__ int64_t items(const int64_t* count, int64_t capacity) {
  if (count == nullptr) return capacity;
  const int64_t n = *count;
  return n < 0 ? 0 : n < capacity ? n : capacity;
}

// This CTA's items [lo, hi): whole tiles, the tiles of `n` in runs of ceil(tiles / grid) a CTA, in order.
struct Range {
  int64_t lo, hi;
};
__device__ __forceinline__ Range cta_range(int64_t n) {
  const int64_t tiles = (n + kTile - 1) / kTile, per_cta = (tiles + gridDim.x - 1) / gridDim.x;
  const int64_t lo = std::min<int64_t>(n, static_cast<int64_t>(blockIdx.x) * per_cta * kTile);
  return {lo, std::min<int64_t>(n, lo + per_cta * kTile)};
}

template <typename K>
__device__ __forceinline__ int digit_of(K key, int shift) {
  return static_cast<int>((key >> shift) & (kDigits - 1));
}

// counts[d * gridDim.x + c]: how many of CTA c's items have digit d. A warp's equal digits are counted by
// one shared atomic (__match_any_sync), so a hot key (a skewed id) costs no more than spread ones; each warp
// has its own histogram.
template <typename K>
__global__ void __launch_bounds__(kThreads) digit_counts(const K* keys, const int64_t* count, int64_t capacity,
                                                         int shift, int32_t* counts) {
  __shared__ int32_t hist[kWarps][kDigits];
  for (int i = threadIdx.x; i < kWarps * kDigits; i += kThreads) hist[i / kDigits][i % kDigits] = 0;
  __syncthreads();
  const Range r = cta_range(items(count, capacity));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t base = r.lo; base < r.hi; base += kThreads * kUnroll) {  // uniform over the CTA
    int digit[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + k * kThreads + threadIdx.x;
      digit[k] = i < r.hi ? digit_of(keys[i], shift) : -1;
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const unsigned active = __ballot_sync(0xffffffffu, digit[k] >= 0);
      if (digit[k] < 0) continue;
      const unsigned peers = __match_any_sync(active, digit[k]);
      if (lane == __ffs(peers) - 1) atomicAdd(&hist[warp][digit[k]], __popc(peers));
    }
  }
  __syncthreads();
  int32_t total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += hist[w][threadIdx.x];
  counts[threadIdx.x * gridDim.x + blockIdx.x] = total;
}

// One pass's writes: CTA c's items of digit d go to starts[d * gridDim.x + c] onwards, in input order.
template <typename K, typename V>
__global__ void __launch_bounds__(kThreads) scatter(const K* keys_in, const V* values_in, K* keys_out, V* values_out,
                                                    const int64_t* count, int64_t capacity, int shift,
                                                    const int32_t* starts) {
  using Rank = cub::BlockRadixRankMatch<kThreads, kDigitBits, /*IS_DESCENDING=*/false>;
  static_assert(Rank::BINS_TRACKED_PER_THREAD == 1, "thread t's digit prefix is digit t's");
  struct Exchange {
    K keys[kTile];
    V values[kTile];
  };
  __shared__ union {
    typename Rank::TempStorage rank;
    Exchange tile;
  } smem;
  __shared__ int64_t next[kDigits];  // the output position of this CTA's next item of each digit
  __shared__ int32_t first[kDigits];  // the tile's first rank of each digit
  const Range r = cta_range(items(count, capacity));
  const int t = threadIdx.x;
  next[t] = starts[t * gridDim.x + blockIdx.x];
  const cub::BFEDigitExtractor<K> digits(shift, kDigitBits);
  for (int64_t lo = r.lo; lo < r.hi; lo += kTile) {
    const int valid = static_cast<int>(std::min<int64_t>(kTile, r.hi - lo));
    K key[kItems];
    V value[kItems];
    cub::LoadDirectWarpStriped(t, keys_in + lo, key, valid, ~K{0});
    cub::LoadDirectWarpStriped(t, values_in + lo, value, valid, V{0});
    int rank[kItems], prefix[1];
    __syncthreads();  // the last tile's exchange has been read; next[] is current
    Rank(smem.rank).RankKeys(key, rank, digits, prefix);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      smem.tile.keys[rank[k]] = key[k];
      smem.tile.values[rank[k]] = value[k];
    }
    first[t] = prefix[0];
    __syncthreads();
    for (int j = t; j < valid; j += kThreads) {
      const K k = smem.tile.keys[j];
      const int d = digit_of(k, shift);
      const int64_t at = next[d] + j - first[d];
      keys_out[at] = k;
      values_out[at] = smem.tile.values[j];
    }
    __syncthreads();
    // the positions past the count rank last, as digit 255: that digit's count ends at `valid`
    next[t] += (t + 1 < kDigits ? first[t + 1] : valid) - first[t];
  }
}

// The grid of every pass: a few CTAs per SM, no more CTAs than the capacity has tiles.
inline int grid_ctas(int64_t capacity) {
  const int sms = device_sms();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(4 * sms, (capacity + kTile - 1) / kTile)));
}

// Sorts the first `count` (a device word; null: all) of `capacity` pairs by their low `bits` key bits,
// ping-ponging between (keys, values) and (keys_alt, values_alt), its counters and the scan's storage from
// `scratch(bytes)`. True when the result is in the alternates.
template <typename K, typename V>
bool sort_pairs(K* keys, V* values, K* keys_alt, V* values_alt, const int64_t* count, int64_t capacity, int bits,
                const std::function<void*(size_t)>& scratch, cudaStream_t stream) {
  PGAS_CHECK(capacity < (int64_t{1} << 31), "counted_sort: %lld positions exceed int32 counters",
             static_cast<long long>(capacity));
  PGAS_CHECK(bits >= 0 && bits <= static_cast<int>(8 * sizeof(K)), "counted_sort: %d key bits for %d-bit keys", bits,
             static_cast<int>(8 * sizeof(K)));
  const int ctas = grid_ctas(capacity), slots = kDigits * ctas;
  int32_t* per_cta = static_cast<int32_t*>(scratch(2 * static_cast<size_t>(slots) * sizeof(int32_t)));
  int32_t* starts = per_cta + slots;
  size_t temp_bytes = 0;
  PGAS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, per_cta, starts, slots, stream));
  void* temp = scratch(std::max<size_t>(temp_bytes, 1));
  bool in_alt = false;
  for (int shift = 0; shift < bits; shift += kDigitBits) {
    const K* ki = in_alt ? keys_alt : keys;
    const V* vi = in_alt ? values_alt : values;
    digit_counts<K><<<ctas, kThreads, 0, stream>>>(ki, count, capacity, shift, per_cta);
    PGAS_CUDA_CHECK(cudaGetLastError());
    PGAS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, per_cta, starts, slots, stream));
    scatter<K, V><<<ctas, kThreads, 0, stream>>>(ki, vi, in_alt ? keys : keys_alt, in_alt ? values : values_alt,
                                                 count, capacity, shift, starts);
    PGAS_CUDA_CHECK(cudaGetLastError());
    in_alt = !in_alt;
  }
  return in_alt;
}

}  // namespace counted_sort
}  // namespace torchrec_pgas
