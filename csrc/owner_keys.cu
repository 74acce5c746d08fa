// The owner update's inputs on the GPU (owner_keys.h): the kept bags, a
// thread each; the keys at a capacity in one kernel whose warps take the bags
// (the positions past the kept ids are not written); their sort over the key
// limit's bits, carrying each key's bag (and per-sample weight: the two
// packed in one 64-bit value): with a count word, counted_sort.cuh over the
// positions it counts; without, CUB's onesweep radix sort over all of them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/device/device_radix_sort.cuh>
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
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 8 * sms)));
}

// The bits a key of at most key_limit needs.
int key_bits(int64_t key_limit) {
  int bits = 1;
  while (bits < 63 && (key_limit >> bits) != 0) ++bits;
  return bits;
}

template <typename key_t, typename value_t>
OwnerKeys sort_pairs(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw, int64_t key_limit,
                     const int64_t* count) {
  using ukey_t = std::make_unsigned_t<key_t>;
  const int64_t n = keys.numel();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto opts = keys.options();
  at::Tensor sorted_keys[2] = {at::empty_like(keys), at::empty_like(keys)};
  const auto value_type = sizeof(value_t) == 8 ? at::kLong : at::kInt;
  at::Tensor values[2] = {at::empty({n}, opts.dtype(value_type)), at::empty({n}, opts.dtype(value_type))};
  const auto key_ptr = [&](int i) { return reinterpret_cast<ukey_t*>(sorted_keys[i].data_ptr()); };
  const auto value_ptr = [&](int i) { return reinterpret_cast<value_t*>(values[i].data_ptr()); };
  sort_input_kernel<key_t, value_t><<<loop_grid(n, count), kThreads, 0, stream>>>(
      keys.data_ptr<key_t>(), bags.data_ptr<int32_t>(), psw.numel() ? psw.data_ptr<float>() : nullptr, count, n,
      key_limit, key_ptr(0), value_ptr(0));
  PGAS_CUDA_CHECK(cudaGetLastError());
  const int bits = key_bits(key_limit);
  int out = 1;
  if (count != nullptr) {  // the count on the device: sort only its positions
    out = counted_sort::sort_pairs<ukey_t, value_t>(key_ptr(0), value_ptr(0), key_ptr(1), value_ptr(1), count, n,
                                                    bits, opts, stream) ? 1 : 0;
  } else {  // every position: CUB's onesweep sort, faster per key (the host knows their number)
    size_t temp_bytes = 0;
    const int items = static_cast<int>(n);
    PGAS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, key_ptr(0), key_ptr(1), value_ptr(0),
                                                    value_ptr(1), items, 0, bits, stream));
    at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, opts.dtype(at::kByte));
    PGAS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, key_ptr(0), key_ptr(1),
                                                    value_ptr(0), value_ptr(1), items, 0, bits, stream));
  }
  if constexpr (sizeof(value_t) == 8) {
    at::Tensor out_bags = at::empty_like(bags), out_psw = at::empty_like(psw);
    unpack_kernel<<<loop_grid(n, count), kThreads, 0, stream>>>(reinterpret_cast<const uint64_t*>(value_ptr(out)),
                                                            count, n, out_bags.data_ptr<int32_t>(),
                                                            out_psw.data_ptr<float>());
    PGAS_CUDA_CHECK(cudaGetLastError());
    return {sorted_keys[out], out_bags, out_psw};
  } else {
    return {sorted_keys[out], values[out], at::empty({0}, psw.options())};  // fresh outputs, as the schema says
  }
}

}  // namespace

OwnerKeys owner_keys_cuda(const at::Tensor& ids, const c10::optional<at::Tensor>& weights, const at::Tensor& first_id,
                          const c10::optional<at::Tensor>& first_weight, const at::Tensor& offsets,
                          const at::Tensor& feature_base, const at::Tensor& config, int64_t capacity) {
  const c10::cuda::CUDAGuard guard(offsets.device());
  OwnerKeys out;
  const OwnerKeysParams p =
      owner_keys_params(ids, weights, first_id, first_weight, offsets, feature_base, config, capacity, out);
  const int64_t threads = 32 * (p.config.end_bag - p.config.first_bag);
  const bool id64 = ids.scalar_type() == at::kLong, key64 = feature_base.scalar_type() == at::kLong;
  const auto launch = [&](auto kernel) {
    kernel<<<grid_for(threads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
    PGAS_CUDA_CHECK(cudaGetLastError());
  };
  if (id64) {
    key64 ? launch(owner_keys_kernel<int64_t, int64_t>) : launch(owner_keys_kernel<int64_t, int32_t>);
  } else {
    key64 ? launch(owner_keys_kernel<int32_t, int64_t>) : launch(owner_keys_kernel<int32_t, int32_t>);
  }
  return out;
}

KeptBags kept_bags_cuda(const at::Tensor& buffer, const at::Tensor& slot_base, const at::Tensor& batches,
                        const c10::optional<at::Tensor>& whole, const at::Tensor& config, int64_t num_bags,
                        bool weighted) {
  const c10::cuda::CUDAGuard guard(buffer.device());
  KeptBags out;
  const KeptBagsParams p = kept_bags_params(buffer, slot_base, batches, whole, config, num_bags, weighted, out);
  const int64_t n = std::get<0>(out).numel();
  if (n > 0) {
    kept_bags_kernel<<<grid_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p, n);
    PGAS_CUDA_CHECK(cudaGetLastError());
  }
  return out;
}

OwnerKeys sort_owner_keys_cuda(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw,
                               int64_t key_limit, const c10::optional<at::Tensor>& count) {
  check_sort_inputs(keys, bags, psw, key_limit, count);
  PGAS_CHECK(keys.numel() < (int64_t{1} << 31), "sort_owner_keys: %lld keys exceed the sort's int32 counters",
             static_cast<long long>(keys.numel()));
  const c10::cuda::CUDAGuard guard(keys.device());
  const bool key64 = keys.scalar_type() == at::kLong, weighted = psw.numel() > 0;
  const int64_t* n = count.has_value() ? count->data_ptr<int64_t>() : nullptr;
  if (key64) {
    return weighted ? sort_pairs<int64_t, uint64_t>(keys, bags, psw, key_limit, n)
                    : sort_pairs<int64_t, uint32_t>(keys, bags, psw, key_limit, n);
  }
  return weighted ? sort_pairs<int32_t, uint64_t>(keys, bags, psw, key_limit, n)
                  : sort_pairs<int32_t, uint32_t>(keys, bags, psw, key_limit, n);
}

}  // namespace torchrec_pgas
