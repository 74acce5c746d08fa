// The owner update's inputs on the GPU (owner_keys.h): the kept bags, a
// thread each; the keys at a capacity in one kernel whose warps take the bags
// (the positions past the kept ids are not written); their sort over the key
// limit's bits, carrying each key's bag (and per-sample weight: the two
// packed in one 64-bit value): with a count word, counted_sort.cuh over the
// positions it counts; without, CUB's onesweep radix sort over all of them.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <type_traits>

#include "counted_sort.cuh"
#include "owner_keys.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;

// A warp per bag (its lanes write adjacent positions).
template <typename id_t, typename key_t>
__global__ void __launch_bounds__(kThreads) owner_keys_kernel(OwnerKeysParams p) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t b = p.config.first_bag + thread / 32; b < p.config.end_bag; b += threads / 32) {
    write_bag_keys<id_t, key_t>(p, b, lane, 32);
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
  const auto key_ptr = [&](int i) { return static_cast<ukey_t*>(s.sorted_keys[i]); };
  const auto value_ptr = [&](int i) { return static_cast<value_t*>(s.values[i]); };
  sort_input_kernel<key_t, value_t><<<loop_grid(s.n, s.count), kThreads, 0, stream>>>(
      static_cast<const key_t*>(s.keys), s.bags, s.psw, s.count, s.n, s.key_limit, key_ptr(0), value_ptr(0));
  PGAS_CUDA_CHECK(cudaGetLastError());
  const int bits = key_bits(s.key_limit);
  if (s.count != nullptr) {  // the count on the device: sort only its positions
    return counted_sort::sort_pairs<ukey_t, value_t>(key_ptr(0), value_ptr(0), key_ptr(1), value_ptr(1), s.count,
                                                     s.n, bits, scratch, stream) ? 1 : 0;
  }
  // every position: CUB's onesweep sort, faster per key (the host knows their number)
  size_t temp_bytes = 0;
  const int items = static_cast<int>(s.n);
  PGAS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, key_ptr(0), key_ptr(1), value_ptr(0),
                                                  value_ptr(1), items, 0, bits, stream));
  PGAS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch(std::max<size_t>(temp_bytes, 1)), temp_bytes, key_ptr(0),
                                                  key_ptr(1), value_ptr(0), value_ptr(1), items, 0, bits, stream));
  return 1;
}

}  // namespace

void launch_owner_keys(const OwnerKeysParams& p, bool ids64, bool keys64, cudaStream_t stream) {
  const int64_t threads = 32 * (p.config.end_bag - p.config.first_bag);
  const auto launch = [&](auto kernel) { kernel<<<grid_for(threads), kThreads, 0, stream>>>(p); };
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
