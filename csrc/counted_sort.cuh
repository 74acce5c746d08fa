// A stable LSD radix sort of (key, value) pairs whose item count is a word
// on the device (or the whole capacity, without one): CUB's onesweep sort,
// its block agents launched by kernels of our own that read the count as
// they start, over grids sized for the capacity. An eager step and a
// captured one then sort only the ids they hold, with no host read of the
// count, fixed shapes for a capture (the capacity stays a maximum), and
// CUB's speed per key.
//
// One sort: a histogram kernel (every digit pass's counts in one read of the
// counted keys: a fixed grid, grid-stride), CUB's exclusive sum over each
// pass's digits (the digits' first output positions), then per pass and
// portion (at most 2^28 items, CUB's lookback limit) one onesweep kernel.
// Its CTAs past the counted tiles return before they take a tile; the others
// take tile indices from the pass's counter in the order they start (as
// many CTAs as counted tiles take one, so the indices are exactly the
// counted tiles), rank their tile by the digit, look back over the earlier
// tiles' digit counts (decoupled lookback) and write each item to its
// digit's next place, in input order within a digit: stable. The last tile
// of a portion writes the next portion's digit starts. The pairs go from
// (keys, values) to the alternates and back, a pass each: no copy in the
// scratch.
//
// Synchronization: every kernel and memset is ordered on one stream; a
// onesweep kernel's lookback words (its counted tiles') are zeroed by a
// kernel before it, every pass's tile counter and digit counts by one memset
// before the histogram. Only the grids (CTAs past the count return at once)
// and the scratch follow the capacity. Each kernel re-reads the count word: a caller
// must not change it while the sort runs.
#pragma once

#include <cub/agent/agent_radix_sort_histogram.cuh>
#include <cub/agent/agent_radix_sort_onesweep.cuh>
#include <cub/detail/choose_offset.cuh>
#include <cub/device/dispatch/dispatch_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <functional>

#include "pgas_check.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace counted_sort {

// The items to sort: *count clamped to [0, capacity] (the whole capacity without a count word).
__device__ __forceinline__ int64_t items(const int64_t* count, int64_t capacity) {
  if (count == nullptr) return capacity;
  const int64_t n = *count;
  return n < 0 ? 0 : n < capacity ? n : capacity;
}

// CUB's sm_90 radix sort policy with onesweep digits of kDigitBits (CUB's own: 8): the same tiles, ranking and
// lookback, over 2^kDigitBits bins. 9-bit digits sort 25-27 key bits (s000's keys) in 3 passes instead of 4.
// One policy, chained to itself: host and device see the same tile (the extension builds for sm_90 alone).
template <typename key_t, typename value_t, typename offset_t, int kDigitBits>
struct DigitPolicyHub {
  using Base = cub::detail::radix::policy_hub<key_t, value_t, offset_t>;
  using Tuned = typename Base::template OnesweepSmallKeyTunedPolicy<
      cub::detail::radix::sm90_small_key_tuning<sizeof(key_t), sizeof(value_t), sizeof(offset_t)>>;
  // The tuned tile as it is (its own scaling type): passed as nominal 4-byte sizes, an 8-byte key or value
  // would scale it a second time.
  struct TunedTile {
    static constexpr int BLOCK_THREADS = Tuned::OnesweepPolicy::BLOCK_THREADS;
    static constexpr int ITEMS_PER_THREAD = Tuned::OnesweepPolicy::ITEMS_PER_THREAD;
  };
  struct Policy900 : cub::ChainedPolicy<900, Policy900, Policy900>, Tuned {
    static constexpr int ONESWEEP_RADIX_BITS = kDigitBits;
    using HistogramPolicy = cub::AgentRadixSortHistogramPolicy<128, 16, 1, key_t, kDigitBits>;
    using ExclusiveSumPolicy = cub::AgentRadixSortExclusiveSumPolicy<256, kDigitBits>;
    using OnesweepPolicy = cub::AgentRadixSortOnesweepPolicy<
        TunedTile::BLOCK_THREADS, TunedTile::ITEMS_PER_THREAD, typename Base::DominantT, 1,
        cub::RADIX_RANK_MATCH_EARLY_COUNTS_ANY, cub::BLOCK_SCAN_RAKING_MEMOIZE, cub::RADIX_SORT_STORE_DIRECT,
        kDigitBits, TunedTile>;
  };
  using MaxPolicy = Policy900;
};
static_assert(CUB_VERSION / 100000 == 3, "DigitPolicyHub builds on CCCL 3's radix sort agents (cub::detail)");

// One sort's types and shapes: unsigned keys K, values V, digits of kDigitBits.
template <typename K, typename V, int kDigitBits>
struct Onesweep {
  using Key = K;
  using Value = V;
  using Offset = cub::detail::choose_offset_t<int>;  // the digits' output positions (CUB's for int counts)
  using Portion = int;  // positions inside a portion, and the lookback words (signed: CUB's)
  using Policy = typename DigitPolicyHub<K, V, Offset, kDigitBits>::MaxPolicy;
  using Decomposer = cub::detail::identity_decomposer_t;
  static constexpr int kDigits = 1 << kDigitBits;
  static constexpr int kHistogramThreads = Policy::HistogramPolicy::BLOCK_THREADS;
  static constexpr int kScanThreads = Policy::ExclusiveSumPolicy::BLOCK_THREADS;
  static constexpr int kThreads = Policy::OnesweepPolicy::BLOCK_THREADS;
  static constexpr int kTile = kThreads * Policy::OnesweepPolicy::ITEMS_PER_THREAD;
  static constexpr Portion kPortion = ((1 << 28) - 1) / kTile * kTile;
};

// Every pass's digit counts of the counted keys, added into bins[pass * kDigits + digit] (zeroed before).
template <typename S>
__global__ void __launch_bounds__(S::kHistogramThreads)
    histogram_kernel(typename S::Offset* bins, const typename S::Key* keys, const int64_t* count, int64_t capacity,
                     int bits) {
  using Agent = cub::detail::radix_sort::AgentRadixSortHistogram<typename S::Policy::HistogramPolicy, false,
                                                                 typename S::Key, typename S::Offset,
                                                                 typename S::Decomposer>;
  __shared__ typename Agent::TempStorage temp;
  const auto n = static_cast<typename S::Offset>(items(count, capacity));
  Agent(temp, bins, keys, n, 0, bits, typename S::Decomposer{}).Process();
}

// The counted items of the portion that starts at item `start` (at most kPortion).
template <typename S>
__device__ __forceinline__ typename S::Portion portion_items(const int64_t* count, int64_t capacity, int64_t start) {
  const int64_t left = items(count, capacity) - start;
  return static_cast<typename S::Portion>(left < 0 ? 0 : left < S::kPortion ? left : S::kPortion);
}

// Zeroes the lookback words of one portion's counted tiles, before its onesweep kernel (its CTAs past them read
// none): the work follows the count, not the capacity.
template <typename S>
__global__ void __launch_bounds__(256)
    zero_lookback_kernel(typename S::Portion* lookback, const int64_t* count, int64_t capacity, int64_t start) {
  const int64_t tiles = (portion_items<S>(count, capacity, start) + S::kTile - 1) / S::kTile;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; i < tiles * S::kDigits;
       i += static_cast<int64_t>(gridDim.x) * 256) {
    lookback[i] = 0;
  }
}

// One pass over one portion's counted items: items [start, start + kPortion) of the input.
template <typename S>
__global__ void __launch_bounds__(S::kThreads)
    onesweep_kernel(typename S::Portion* lookback, typename S::Portion* tiles, typename S::Offset* next_bins,
                    const typename S::Offset* bins, typename S::Key* keys_out, const typename S::Key* keys_in,
                    typename S::Value* values_out, const typename S::Value* values_in, const int64_t* count,
                    int64_t capacity, int64_t start, int bit, int num_bits) {
  const typename S::Portion n = portion_items<S>(count, capacity, start);
  if (static_cast<int64_t>(blockIdx.x) * S::kTile >= n) return;  // past the counted tiles: takes no tile index
  using Agent = cub::detail::radix_sort::AgentRadixSortOnesweep<typename S::Policy::OnesweepPolicy, false,
                                                                typename S::Key, typename S::Value,
                                                                typename S::Offset, typename S::Portion,
                                                                typename S::Decomposer>;
  __shared__ typename Agent::TempStorage temp;
  Agent(temp, lookback, tiles, next_bins, bins, keys_out, keys_in + start, values_out, values_in + start, n, bit,
        num_bits, typename S::Decomposer{})
      .Process();
}

// Sorts the first `count` (a device word; null: all) of `capacity` pairs by their low `bits` key bits,
// ping-ponging between (keys, values) and (keys_alt, values_alt), its digit counts, lookback words and tile
// counters from `scratch(bytes)`. True when the result is in the alternates.
template <typename K, typename V, int kDigitBits>
bool sort_pairs(K* keys, V* values, K* keys_alt, V* values_alt, const int64_t* count, int64_t capacity, int bits,
                const std::function<void*(size_t)>& scratch, cudaStream_t stream) {
  using S = Onesweep<K, V, kDigitBits>;
  PGAS_CHECK(capacity < (int64_t{1} << 31), "counted_sort: %lld positions exceed int32 offsets",
             static_cast<long long>(capacity));
  PGAS_CHECK(bits >= 0 && bits <= static_cast<int>(8 * sizeof(K)), "counted_sort: %d key bits for %d-bit keys", bits,
             static_cast<int>(8 * sizeof(K)));
  const int passes = (bits + kDigitBits - 1) / kDigitBits;
  if (passes == 0 || capacity == 0) return false;
  const int64_t portions = (capacity + S::kPortion - 1) / S::kPortion;
  const int64_t portion_tiles = (std::min<int64_t>(capacity, S::kPortion) + S::kTile - 1) / S::kTile;
  // the digit counts, then the tile counters: one allocation, zeroed by one memset
  static_assert(sizeof(typename S::Offset) == sizeof(typename S::Portion), "bins and tile counters share a buffer");
  const size_t bin_count = static_cast<size_t>(portions) * passes * S::kDigits;
  const size_t counters = bin_count + static_cast<size_t>(portions) * passes;
  auto* bins = static_cast<typename S::Offset*>(scratch(counters * sizeof(typename S::Offset)));
  auto* tiles = reinterpret_cast<typename S::Portion*>(bins + bin_count);
  auto* lookback = static_cast<typename S::Portion*>(scratch(portion_tiles * S::kDigits * sizeof(typename S::Portion)));
  PGAS_CUDA_CHECK(cudaMemsetAsync(bins, 0, counters * sizeof(typename S::Offset), stream));
  static const int histogram_ctas = resident_ctas(histogram_kernel<S>, S::kHistogramThreads);  // asked once
  histogram_kernel<S><<<histogram_ctas, S::kHistogramThreads, 0, stream>>>(bins, keys, count, capacity, bits);
  PGAS_CUDA_CHECK(cudaGetLastError());
  cub::detail::radix_sort::DeviceRadixSortExclusiveSumKernel<typename S::Policy, typename S::Offset>
      <<<passes, S::kScanThreads, 0, stream>>>(bins);
  PGAS_CUDA_CHECK(cudaGetLastError());
  const int64_t zero_ctas = 4 * static_cast<int64_t>(device_sms());
  bool in_alt = false;
  for (int pass = 0; pass < passes; ++pass) {
    const int bit = pass * kDigitBits, num_bits = std::min(bits - bit, kDigitBits);
    for (int64_t portion = 0; portion < portions; ++portion) {
      const int64_t start = portion * S::kPortion;
      const int64_t tiles_here = (std::min<int64_t>(capacity - start, S::kPortion) + S::kTile - 1) / S::kTile;
      const int zero_grid = static_cast<int>(std::min<int64_t>((tiles_here * S::kDigits + 255) / 256, zero_ctas));
      zero_lookback_kernel<S><<<zero_grid, 256, 0, stream>>>(lookback, count, capacity, start);
      PGAS_CUDA_CHECK(cudaGetLastError());
      auto* here = bins + (portion * passes + pass) * S::kDigits;
      auto* next = portion + 1 < portions ? bins + ((portion + 1) * passes + pass) * S::kDigits : nullptr;
      onesweep_kernel<S><<<static_cast<int>(tiles_here), S::kThreads, 0, stream>>>(
          lookback, tiles + portion * passes + pass, next, here, in_alt ? keys : keys_alt, in_alt ? keys_alt : keys,
          in_alt ? values : values_alt, in_alt ? values_alt : values, count, capacity, start, bit, num_bits);
      PGAS_CUDA_CHECK(cudaGetLastError());
    }
    in_alt = !in_alt;
  }
  return in_alt;
}

}  // namespace counted_sort
}  // namespace torchrec_pgas
