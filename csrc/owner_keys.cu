// The owner update's inputs on the GPU (owner_keys.h): the kept bags, a
// thread each; the keys at a capacity in one kernel whose warps take the bags,
// then its threads the padding positions (the kept count is read on the
// device); their sort by CUB's radix sort over the key limit's bits, carrying
// each key's bag (and per-sample weight: the two packed in one 64-bit value).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/device/device_radix_sort.cuh>

#include <type_traits>

#include "owner_keys.h"
#include "pgas_common.cuh"

namespace torchrec_pgas {
namespace {

constexpr int kThreads = 256;

// A warp per bag (its lanes write adjacent positions), then a thread per padding position.
template <typename id_t, typename key_t>
__global__ void __launch_bounds__(kThreads) owner_keys_kernel(OwnerKeysParams p) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t b = p.config.first_bag + thread / 32; b < p.config.end_bag; b += threads / 32) {
    write_bag_keys<id_t, key_t>(p, b, lane, 32);
  }
  for (int64_t q = kept_count(p) + thread; q < p.capacity; q += threads) pad_position<key_t>(p, q);
}

__global__ void __launch_bounds__(kThreads) kept_bags_kernel(KeptBagsParams p, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    write_kept_bag(p, i);
  }
}

// The sort's input: clamped keys (unsigned: CUB then orders the key limit's low bits) and each key's value,
// its bag, or its bag and weight's bits packed (bag low).
template <typename key_t, typename value_t>
__global__ void __launch_bounds__(kThreads) sort_input_kernel(const key_t* keys, const int32_t* bags, const float* psw,
                                                              int64_t n, int64_t key_limit,
                                                              std::make_unsigned_t<key_t>* keys_out, value_t* values) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    keys_out[i] = static_cast<std::make_unsigned_t<key_t>>(clamped_key(keys[i], key_limit));
    if constexpr (sizeof(value_t) == 8) {
      values[i] = static_cast<uint32_t>(bags[i]) | static_cast<uint64_t>(__float_as_uint(psw[i])) << 32;
    } else {
      values[i] = static_cast<uint32_t>(bags[i]);
    }
  }
}

__global__ void __launch_bounds__(kThreads) unpack_kernel(const uint64_t* values, int64_t n, int32_t* bags,
                                                           float* psw) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    bags[i] = static_cast<int32_t>(static_cast<uint32_t>(values[i]));
    psw[i] = __uint_as_float(static_cast<uint32_t>(values[i] >> 32));
  }
}

int grid_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65536)));
}

// The bits a key of at most key_limit needs.
int key_bits(int64_t key_limit) {
  int bits = 1;
  while (bits < 63 && (key_limit >> bits) != 0) ++bits;
  return bits;
}

template <typename key_t, typename value_t>
OwnerKeys sort_pairs(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw,
                                   int64_t key_limit) {
  using ukey_t = std::make_unsigned_t<key_t>;
  const int64_t n = keys.numel();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto opts = keys.options();
  at::Tensor in_keys = at::empty_like(keys), out_keys = at::empty_like(keys);
  at::Tensor in_values = at::empty({n}, opts.dtype(sizeof(value_t) == 8 ? at::kLong : at::kInt));
  at::Tensor out_values = at::empty_like(in_values);
  auto* ik = reinterpret_cast<ukey_t*>(in_keys.data_ptr());
  auto* iv = reinterpret_cast<value_t*>(in_values.data_ptr());
  sort_input_kernel<key_t, value_t><<<grid_for(n), kThreads, 0, stream>>>(
      keys.data_ptr<key_t>(), bags.data_ptr<int32_t>(), psw.numel() ? psw.data_ptr<float>() : nullptr, n, key_limit,
      ik, iv);
  PGAS_CUDA_CHECK(cudaGetLastError());
  auto* ok = reinterpret_cast<ukey_t*>(out_keys.data_ptr());
  auto* ov = reinterpret_cast<value_t*>(out_values.data_ptr());
  size_t temp_bytes = 0;
  const int bits = key_bits(key_limit), items = static_cast<int>(n);
  PGAS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ik, ok, iv, ov, items, 0, bits, stream));
  at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, opts.dtype(at::kByte));
  PGAS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, ik, ok, iv, ov, items, 0, bits, stream));
  if constexpr (sizeof(value_t) == 8) {
    at::Tensor out_bags = at::empty_like(bags), out_psw = at::empty_like(psw);
    unpack_kernel<<<grid_for(n), kThreads, 0, stream>>>(reinterpret_cast<const uint64_t*>(ov), n,
                                                        out_bags.data_ptr<int32_t>(), out_psw.data_ptr<float>());
    PGAS_CUDA_CHECK(cudaGetLastError());
    return {out_keys, out_bags, out_psw};
  } else {
    return {out_keys, out_values, at::empty({0}, psw.options())};  // a fresh output, as the schema says
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
  const int64_t threads = std::max(p.capacity, 32 * (p.config.end_bag - p.config.first_bag));
  const bool id64 = ids.scalar_type() == at::kLong, key64 = feature_base.scalar_type() == at::kLong;
  const auto launch = [&](auto kernel) {
    kernel<<<grid_for(threads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
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
    kept_bags_kernel<<<grid_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p, n);
    PGAS_CUDA_CHECK(cudaGetLastError());
  }
  return out;
}

OwnerKeys sort_owner_keys_cuda(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw,
                               int64_t key_limit) {
  check_sort_inputs(keys, bags, psw, key_limit);
  PGAS_CHECK(keys.numel() < (int64_t{1} << 31), "sort_owner_keys: %lld keys exceed CUB's int item count",
             static_cast<long long>(keys.numel()));
  const c10::cuda::CUDAGuard guard(keys.device());
  const bool key64 = keys.scalar_type() == at::kLong, weighted = psw.numel() > 0;
  if (key64) {
    return weighted ? sort_pairs<int64_t, uint64_t>(keys, bags, psw, key_limit)
                    : sort_pairs<int64_t, uint32_t>(keys, bags, psw, key_limit);
  }
  return weighted ? sort_pairs<int32_t, uint64_t>(keys, bags, psw, key_limit)
                  : sort_pairs<int32_t, uint32_t>(keys, bags, psw, key_limit);
}

}  // namespace torchrec_pgas
