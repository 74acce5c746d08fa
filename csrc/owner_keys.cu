// The owner update's inputs on the GPU (owner_keys.h): the kept bags, a
// thread each; the keys at a capacity in one kernel whose warps take 32 bags a group
// (the positions past the kept ids are not written); their sort over the key
// limit's bits, carrying each key's bag (and per-sample weight: the two
// packed in one 64-bit value): counted_sort.cuh (CUB's onesweep) over the
// positions a count word counts, or over all of them without one.
#include <algorithm>
#include <type_traits>

#include "counted_sort.cuh"
#include "owner_keys.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;

// A group of 32 consecutive bags per `split` warps. Each warp's lane l reads bag b0 + l's span (one round of loads
// for the 32 bags, not a dependent chain a bag) into the warp's slots in shared memory, with the running count of
// the spans' positions (a shuffle scan); then the warp writes its share of the concatenation of the spans: rounds
// of 32 positions, kRounds at a time, their ids read before any is written, the group's warps taking every
// split-th batch of kRounds rounds (long bags: many warps a group). Position v belongs to the first lane whose
// running count passes v (a binary search over the counts), at its span's q_lo + (v - its start). Consecutive
// bags' spans are adjacent, so a round's stores are too. Every position written lies in its bag's span, inside
// the capacity, whatever the offsets say (spans that overlap: memory-safe, meaningless).
constexpr int kWarps = kThreads / 32;
constexpr int kRounds = 4;

// The lane whose positions hold position v of the 32 spans' concatenation (ends: their running counts;
// v < ends[31]).
__device__ __forceinline__ int span_of(const int64_t* ends, int64_t v) {
  int l = 0;
  for (int step = 16; step > 0; step >>= 1) {
    if (ends[l + step - 1] <= v) l += step;
  }
  return l;
}

template <typename id_t, typename key_t>
__global__ void __launch_bounds__(kThreads, 4) owner_keys_kernel(OwnerKeysParams p, int split) {
  __shared__ BagSpan spans[kWarps][32];
  __shared__ int64_t ends[kWarps][32];
  const int lane = static_cast<int>(threadIdx.x % 32);
  BagSpan* warp_spans = spans[threadIdx.x / 32];
  int64_t* warp_ends = ends[threadIdx.x / 32];
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * kWarps / split;
  if (warp >= groups * split) return;  // the grid's last warps, short of a whole set of `split`
  const int64_t part = warp % split;  // this warp's share of its group's positions
  for (int64_t b0 = p.config.first_bag + 32 * (warp / split); b0 < p.config.end_bag; b0 += 32 * groups) {
    const int64_t b = b0 + lane;
    const BagSpan span = b < p.config.end_bag ? bag_span<key_t>(p, b) : BagSpan{0, 0, 0, 0, 0};
    int64_t end = span.q_hi - span.q_lo;  // >= 0
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t below = __shfl_up_sync(0xffffffffu, end, o);
      if (lane >= o) end += below;
    }
    const int64_t total = __shfl_sync(0xffffffffu, end, 31);
    __syncwarp();  // the previous group's reads of the slots are done
    warp_spans[lane] = span;
    warp_ends[lane] = end;
    __syncwarp();
    for (int64_t v0 = 32 * kRounds * part + lane; v0 < total; v0 += 32 * kRounds * split) {
      int owner[kRounds];
      int64_t q[kRounds];
      PositionRead read[kRounds];
#pragma unroll
      for (int k = 0; k < kRounds; ++k) {  // loads only
        const int64_t v = v0 + 32 * k;
        owner[k] = v < total ? span_of(warp_ends, v) : -1;
        if (owner[k] < 0) continue;
        const BagSpan& s = warp_spans[owner[k]];
        q[k] = s.q_hi - (warp_ends[owner[k]] - v);  // its span ends where its running count does
        read[k] = read_position<id_t>(p, s, q[k]);
      }
#pragma unroll
      for (int k = 0; k < kRounds; ++k) {
        if (owner[k] >= 0) write_position<key_t>(p, warp_spans[owner[k]], b0 + owner[k], q[k], read[k]);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) kept_bags_kernel(KeptBagsParams p, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    write_kept_bag(p, i);
  }
}

// The sort's input: clamped keys (unsigned: the sort then orders the key limit's low bits) and each key's
// value, its bag, or its bag and weight's bits packed (bag low).
template <typename key_t, typename value_t>
__global__ void __launch_bounds__(kThreads) sort_input_kernel(const key_t* keys, const int32_t* bags, const float* psw,
                                                              const int64_t* count, int64_t n, int64_t key_limit,
                                                              std::make_unsigned_t<key_t>* keys_out, value_t* values) {
  const int64_t end = counted_sort::items(count, n);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    keys_out[i] = static_cast<std::make_unsigned_t<key_t>>(clamped_key(keys[i], key_limit));
    if constexpr (sizeof(value_t) == 8) {
      values[i] = static_cast<uint32_t>(bags[i]) | static_cast<uint64_t>(__float_as_uint(psw[i])) << 32;
    } else {
      values[i] = static_cast<uint32_t>(bags[i]);
    }
  }
}

__global__ void __launch_bounds__(kThreads) unpack_kernel(const uint64_t* values, const int64_t* count, int64_t n,
                                                          int32_t* bags, float* psw) {
  const int64_t end = counted_sort::items(count, n);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    bags[i] = static_cast<int32_t>(static_cast<uint32_t>(values[i]));
    psw[i] = __uint_as_float(static_cast<uint32_t>(values[i] >> 32));
  }
}

int grid_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65536)));
}

// The grid of a grid-stride loop over n positions, or over those a device word counts: then sized by the SMs,
// not by the capacity (the loop's work follows the count).
int loop_grid(int64_t n, const int64_t* count) {
  if (count == nullptr) return grid_for(n);
  const int64_t sms = device_sms();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 8 * sms)));
}

// The bits a key of at most key_limit needs.
int key_bits(int64_t key_limit) {
  int bits = 1;
  while (bits < 63 && (key_limit >> bits) != 0) ++bits;
  return bits;
}

template <typename key_t, typename value_t>
int sort_typed(const SortPairs& s, const std::function<void*(size_t)>& scratch, cudaStream_t stream) {
  using ukey_t = std::make_unsigned_t<key_t>;
  ukey_t* const keys[2] = {static_cast<ukey_t*>(s.sorted_keys[0]), static_cast<ukey_t*>(s.sorted_keys[1])};
  value_t* const values[2] = {static_cast<value_t*>(s.values[0]), static_cast<value_t*>(s.values[1])};
  sort_input_kernel<key_t, value_t><<<loop_grid(s.n, s.count), kThreads, 0, stream>>>(
      static_cast<const key_t*>(s.keys), s.bags, s.psw, s.count, s.n, s.key_limit, keys[0], values[0]);
  PGAS_CUDA_CHECK(cudaGetLastError());
  const int bits = key_bits(s.key_limit);
  // 9-bit digits where they take a pass fewer than 8-bit ones (CUB's)
  const bool in_alt = (bits + 8) / 9 < (bits + 7) / 8
                          ? counted_sort::sort_pairs<ukey_t, value_t, 9>(keys[0], values[0], keys[1], values[1],
                                                                         s.count, s.n, bits, scratch, stream)
                          : counted_sort::sort_pairs<ukey_t, value_t, 8>(keys[0], values[0], keys[1], values[1],
                                                                         s.count, s.n, bits, scratch, stream);
  return in_alt ? 1 : 0;
}

}  // namespace

void launch_owner_keys(const OwnerKeysParams& p, bool ids64, bool keys64, cudaStream_t stream) {
  // Warps a group of 32 bags: about one for every 1,024 of its positions the capacity allows on average (1 at
  // s000-strong's 16 ids a bag, 2 at s000-weak's 64), a power of two up to 32.
  const int64_t bags = p.config.end_bag - p.config.first_bag;
  const int64_t per_group = p.capacity / std::max<int64_t>(1, bags) * 32;
  int split = 1;
  while (split < 32 && 1024 * 2 * split <= per_group) split *= 2;
  const int64_t threads = (bags + 31) / 32 * split * 32;
  const auto launch = [&](auto kernel) { kernel<<<grid_for(threads), kThreads, 0, stream>>>(p, split); };
  if (ids64) {
    keys64 ? launch(owner_keys_kernel<int64_t, int64_t>) : launch(owner_keys_kernel<int64_t, int32_t>);
  } else {
    keys64 ? launch(owner_keys_kernel<int32_t, int64_t>) : launch(owner_keys_kernel<int32_t, int32_t>);
  }
  PGAS_CUDA_CHECK(cudaGetLastError());
}

void launch_kept_bags(const KeptBagsParams& p, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  kept_bags_kernel<<<grid_for(n), kThreads, 0, stream>>>(p, n);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

int launch_sort_pairs(const SortPairs& s, const std::function<void*(size_t)>& scratch, cudaStream_t stream) {
  const bool weighted = s.psw != nullptr;
  if (s.keys64) {
    return weighted ? sort_typed<int64_t, uint64_t>(s, scratch, stream)
                    : sort_typed<int64_t, uint32_t>(s, scratch, stream);
  }
  return weighted ? sort_typed<int32_t, uint64_t>(s, scratch, stream)
                  : sort_typed<int32_t, uint32_t>(s, scratch, stream);
}

void launch_unpack_values(const uint64_t* values, const int64_t* count, int64_t n, int32_t* bags, float* psw,
                          cudaStream_t stream) {
  unpack_kernel<<<loop_grid(n, count), kThreads, 0, stream>>>(values, count, n, bags, psw);
  PGAS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchrec_pgas
