// The owner keys' host side: the inputs checked (they decide the positions
// written and the buffer elements read), the parameters built, the GPU ops'
// launches (their kernels: owner_keys.cu), and the CPU path: the same per-bag
// and per-position code, then a stable sort of the counted positions.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sort.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "op_config.h"
#include "owner_keys.h"

namespace torchrec_pgas {

using OwnerKeys = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // keys, bags, per-sample weights (or empty)
using KeptBags = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // lengths, first_id, first_weight (or empty)

namespace {

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t at_least,
                  const at::Device& device) {
  PGAS_CHECK(t.scalar_type() == dtype && t.dim() == 1 && t.is_contiguous() && t.device() == device,
             "owner_keys: %s must be a contiguous 1-D %s tensor beside the offsets", name, c10::toString(dtype));
  PGAS_CHECK(t.numel() >= at_least, "owner_keys: %s has %lld elements, at least %lld needed", name,
             static_cast<long long>(t.numel()), static_cast<long long>(at_least));
}

OwnerKeysConfig checked_keys_config(const at::Tensor& config) {
  const OwnerKeysConfig c = config_from_bytes<OwnerKeysConfig>(config, "owner_keys", "an OwnerKeysConfig");
  PGAS_CHECK(c.first_bag >= 0 && c.end_bag >= c.first_bag && c.stride > 0 && (c.end_bag - c.first_bag) % c.stride == 0,
             "owner_keys: bags [%lld, %lld) are not whole features of %lld bags", static_cast<long long>(c.first_bag),
             static_cast<long long>(c.end_bag), static_cast<long long>(c.stride));
  PGAS_CHECK(c.end_bag - c.first_bag < (int64_t{1} << 31), "owner_keys: %lld bags exceed int32 bag numbers",
             static_cast<long long>(c.end_bag - c.first_bag));
  PGAS_CHECK(c.key_limit > 0, "owner_keys: key_limit %lld must be positive", static_cast<long long>(c.key_limit));
  return c;
}

KeptBagsConfig checked_bags_config(const at::Tensor& config) {
  const KeptBagsConfig c = config_from_bytes<KeptBagsConfig>(config, "kept_bags", "a KeptBagsConfig");
  // Every field, and the extents its products give, far past any buffer yet far from overflow: an index
  // block's offsets, the slot's blocks (world * index_block_bytes) and a block's bags fit 2^40 bytes.
  const int64_t kLimit = int64_t{1} << 40;
  const auto fits = [&](int64_t a, int64_t b) {
    int64_t product = 0;
    return a >= 0 && b >= 0 && a < kLimit && b < kLimit && !c10::mul_overflows(a, b, &product) && product < kLimit;
  };
  PGAS_CHECK(fits(c.world, c.index_block_bytes) && fits(c.features_per_block, c.max_batch) &&
                 fits(c.num_features, c.world) && fits(c.num_features * c.world, c.rows) &&  // in order: no overflow
                 fits(c.lengths_off, 1) && fits(c.offsets_off, 1) && fits(c.ids_off, 1) &&
                 (c.weights_off == -1 || fits(c.weights_off, 1)) && fits(c.first_feature, 1),
             "kept_bags: a KeptBagsConfig field is negative or its extent past 2^40 bytes");
  PGAS_CHECK(c.world > 0 && c.rows >= 0 && c.rows <= c.max_batch && c.index_block_bytes > 0,
             "kept_bags: world %lld, rows %lld of max_batch %lld, index blocks of %lld bytes",
             static_cast<long long>(c.world), static_cast<long long>(c.rows), static_cast<long long>(c.max_batch),
             static_cast<long long>(c.index_block_bytes));
  PGAS_CHECK(c.first_feature >= 0 && c.num_features >= 0 && c.first_feature + c.num_features <= c.features_per_block,
             "kept_bags: features [%lld, +%lld) outside a block's %lld", static_cast<long long>(c.first_feature),
             static_cast<long long>(c.num_features), static_cast<long long>(c.features_per_block));
  PGAS_CHECK(c.id_bytes == 4 || c.id_bytes == 8, "kept_bags: id_bytes %lld is not 4 or 8",
             static_cast<long long>(c.id_bytes));
  return c;
}

// The kept bags' outputs, uninitialised: every bag is written.
KeptBags empty_kept_bags(const at::Tensor& buffer, int64_t num_bags, bool weighted) {
  const auto opts = buffer.options().dtype(at::kLong);
  return {at::empty({num_bags}, opts), at::empty({num_bags}, opts), at::empty({weighted ? num_bags : 0}, opts)};
}

// The outputs, uninitialised: the TBE's kept ids' positions are written, those past them are not.
OwnerKeys empty_owner_keys(const at::Tensor& offsets, const at::Tensor& feature_base, bool weighted, int64_t capacity) {
  const auto opts = offsets.options();
  return {at::empty({capacity}, opts.dtype(feature_base.scalar_type())), at::empty({capacity}, opts.dtype(at::kInt)),
          at::empty({weighted ? capacity : 0}, opts.dtype(at::kFloat))};
}

template <typename id_t, typename key_t>
void owner_keys_on_host(const OwnerKeysParams& p) {
  for (int64_t b = p.config.first_bag; b < p.config.end_bag; ++b) write_bag_keys<id_t, key_t>(p, b);
}

template <typename key_t>
at::Tensor clamped_keys(const at::Tensor& keys, int64_t key_limit) {
  at::Tensor out = keys.clone();
  auto* k = out.data_ptr<key_t>();
  for (int64_t i = 0; i < out.numel(); ++i) k[i] = clamped_key(k[i], key_limit);
  return out;
}

// The inputs checked, naming the bad one, and the parameters built; `out` receives the outputs.
OwnerKeysParams owner_keys_params(const at::Tensor& ids, const c10::optional<at::Tensor>& weights,
                                  const at::Tensor& first_id, const c10::optional<at::Tensor>& first_weight,
                                  const at::Tensor& offsets, const at::Tensor& feature_base,
                                  const at::Tensor& config, int64_t capacity, OwnerKeys& out) {
  const OwnerKeysConfig c = checked_keys_config(config);
  PGAS_CHECK(capacity >= 0 && capacity < (int64_t{1} << 31), "owner_keys: capacity %lld outside [0, 2^31)",
             static_cast<long long>(capacity));
  const at::Device device = offsets.device();
  check_vector(offsets, "offsets", at::kLong, c.end_bag + 1, device);
  check_vector(first_id, "first_id", at::kLong, c.end_bag, device);
  PGAS_CHECK(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, "owner_keys: ids must be int32 or int64");
  check_vector(ids, "ids", ids.scalar_type(), 0, device);
  PGAS_CHECK(feature_base.scalar_type() == at::kInt || feature_base.scalar_type() == at::kLong,
             "owner_keys: feature_base must be int32 or int64 (the keys' dtype)");
  check_vector(feature_base, "feature_base", feature_base.scalar_type(), (c.end_bag - c.first_bag) / c.stride, device);
  PGAS_CHECK(feature_base.scalar_type() == at::kLong || c.key_limit < (int64_t{1} << 31),
             "owner_keys: key_limit %lld does not fit int32 keys", static_cast<long long>(c.key_limit));
  PGAS_CHECK(weights.has_value() == first_weight.has_value(),
             "owner_keys: weights and first_weight come together (a weighted step) or not at all");
  if (weights.has_value()) {
    check_vector(*weights, "weights", at::kFloat, 0, device);
    check_vector(*first_weight, "first_weight", at::kLong, c.end_bag, device);
  }
  out = empty_owner_keys(offsets, feature_base, weights.has_value(), capacity);
  return OwnerKeysParams{
      ids.data_ptr(), ids.numel(),
      weights.has_value() ? weights->data_ptr<float>() : nullptr, weights.has_value() ? weights->numel() : 0,
      first_id.data_ptr<int64_t>(), first_weight.has_value() ? first_weight->data_ptr<int64_t>() : nullptr,
      offsets.data_ptr<int64_t>(), feature_base.data_ptr(), c, capacity,
      std::get<0>(out).data_ptr(), std::get<1>(out).data_ptr<int32_t>(),
      weights.has_value() ? std::get<2>(out).data_ptr<float>() : nullptr,
  };
}

// Kept bags' inputs checked, naming the bad one, the outputs allocated into `out`.
KeptBagsParams kept_bags_params(const at::Tensor& buffer, const at::Tensor& slot_base, const at::Tensor& batches,
                                const c10::optional<at::Tensor>& whole, const at::Tensor& config, int64_t num_bags,
                                bool weighted, KeptBags& out) {
  const KeptBagsConfig c = checked_bags_config(config);
  PGAS_CHECK(num_bags == c.num_features * c.world * c.rows && weighted == (c.weights_off >= 0),
             "kept_bags: num_bags %lld, weighted %d are not the config's %lld bags, weighted %d",
             static_cast<long long>(num_bags), static_cast<int>(weighted),
             static_cast<long long>(c.num_features * c.world * c.rows), static_cast<int>(c.weights_off >= 0));
  const at::Device device = buffer.device();
  PGAS_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous() &&
                 reinterpret_cast<uintptr_t>(buffer.data_ptr()) % 8 == 0,
             "kept_bags: buffer must be a contiguous 1-D uint8 tensor starting on 8 bytes");
  PGAS_CHECK(slot_base.scalar_type() == at::kLong && slot_base.numel() == 1 && slot_base.device() == device,
             "kept_bags: slot_base must be one int64 on the buffer's device");
  PGAS_CHECK(batches.scalar_type() == at::kLong && batches.dim() == 1 && batches.is_contiguous() &&
                 batches.numel() == c.world && batches.device() == device,
             "kept_bags: batches must be %lld contiguous int64 on the buffer's device (one a source)",
             static_cast<long long>(c.world));
  PGAS_CHECK(!whole.has_value() || (whole->scalar_type() == at::kBool && whole->numel() == 1 &&
                                     whole->device() == device),
             "kept_bags: whole must be one bool on the buffer's device");
  out = empty_kept_bags(buffer, num_bags, weighted);
  return KeptBagsParams{
      buffer.data_ptr<uint8_t>(), buffer.numel(), slot_base.data_ptr<int64_t>(),  // one element: contiguous
      batches.data_ptr<int64_t>(), whole.has_value() ? whole->data_ptr<bool>() : nullptr, c,
      std::get<0>(out).data_ptr<int64_t>(), std::get<1>(out).data_ptr<int64_t>(),
      c.weights_off >= 0 ? std::get<2>(out).data_ptr<int64_t>() : nullptr,
  };
}

// The sort's checks: keys int32 or int64, bags int32 and psw fp32 (or empty) of the keys' length, count one
// int64 on their device (or none).
void check_sort_inputs(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw, int64_t key_limit,
                       const c10::optional<at::Tensor>& count) {
  PGAS_CHECK((keys.scalar_type() == at::kInt || keys.scalar_type() == at::kLong) && keys.dim() == 1 &&
                 keys.is_contiguous(), "sort_owner_keys: keys must be a contiguous 1-D int32 or int64 tensor");
  PGAS_CHECK(bags.scalar_type() == at::kInt && bags.is_contiguous() && bags.numel() == keys.numel(),
             "sort_owner_keys: bags must be contiguous int32, one per key");
  PGAS_CHECK(psw.scalar_type() == at::kFloat && psw.is_contiguous() &&
                 (psw.numel() == 0 || psw.numel() == keys.numel()),
             "sort_owner_keys: per_sample_weights must be contiguous fp32, one per key (or empty)");
  PGAS_CHECK(bags.device() == keys.device() && psw.device() == keys.device(),
             "sort_owner_keys: keys, bags and per_sample_weights must be on one device");
  PGAS_CHECK(key_limit > 0 && (keys.scalar_type() == at::kLong || key_limit < (int64_t{1} << 31)),
             "sort_owner_keys: key_limit %lld must be positive and fit the keys", static_cast<long long>(key_limit));
  PGAS_CHECK(!count.has_value() || (count->scalar_type() == at::kLong && count->numel() == 1 &&
                                     count->device() == keys.device()),
             "sort_owner_keys: count must be one int64 on the keys' device");
}

}  // namespace

// CPU implementations (the same algorithm as owner_keys.cu).
KeptBags kept_bags_cpu(const at::Tensor& buffer, const at::Tensor& slot_base, const at::Tensor& batches,
                       const c10::optional<at::Tensor>& whole, const at::Tensor& config, int64_t num_bags,
                       bool weighted) {
  KeptBags out;
  const KeptBagsParams p = kept_bags_params(buffer, slot_base, batches, whole, config, num_bags, weighted, out);
  for (int64_t i = 0; i < std::get<0>(out).numel(); ++i) write_kept_bag(p, i);
  return out;
}

OwnerKeys owner_keys_cpu(const at::Tensor& ids, const c10::optional<at::Tensor>& weights, const at::Tensor& first_id,
                         const c10::optional<at::Tensor>& first_weight, const at::Tensor& offsets,
                         const at::Tensor& feature_base, const at::Tensor& config, int64_t capacity) {
  OwnerKeys out;
  const OwnerKeysParams p =
      owner_keys_params(ids, weights, first_id, first_weight, offsets, feature_base, config, capacity, out);
  const bool id64 = ids.scalar_type() == at::kLong, key64 = feature_base.scalar_type() == at::kLong;
  if (id64) {
    key64 ? owner_keys_on_host<int64_t, int64_t>(p) : owner_keys_on_host<int64_t, int32_t>(p);
  } else {
    key64 ? owner_keys_on_host<int32_t, int64_t>(p) : owner_keys_on_host<int32_t, int32_t>(p);
  }
  return out;
}

OwnerKeys sort_owner_keys_cpu(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw,
                              int64_t key_limit, const c10::optional<at::Tensor>& count) {
  check_sort_inputs(keys, bags, psw, key_limit, count);
  const int64_t n = keys.numel();
  const int64_t sorted = count.has_value() ? std::clamp<int64_t>(count->item<int64_t>(), 0, n) : n;
  const at::Tensor head = keys.narrow(0, 0, sorted);
  const at::Tensor in_range =
      keys.scalar_type() == at::kLong ? clamped_keys<int64_t>(head, key_limit) : clamped_keys<int32_t>(head, key_limit);
  const at::Tensor order = std::get<1>(at::sort(in_range, /*stable=*/std::optional<bool>(true), /*dim=*/0));
  OwnerKeys out{at::empty_like(keys), at::empty_like(bags), at::empty_like(psw)};  // past the count: not written
  std::get<0>(out).narrow(0, 0, sorted).copy_(in_range.index_select(0, order));
  std::get<1>(out).narrow(0, 0, sorted).copy_(bags.index_select(0, order));
  if (psw.numel()) std::get<2>(out).narrow(0, 0, sorted).copy_(psw.index_select(0, order));
  return out;
}

// GPU implementations (their kernels: owner_keys.cu).
KeptBags kept_bags_cuda(const at::Tensor& buffer, const at::Tensor& slot_base, const at::Tensor& batches,
                        const c10::optional<at::Tensor>& whole, const at::Tensor& config, int64_t num_bags,
                        bool weighted) {
  const c10::cuda::CUDAGuard guard(buffer.device());
  KeptBags out;
  const KeptBagsParams p = kept_bags_params(buffer, slot_base, batches, whole, config, num_bags, weighted, out);
  launch_kept_bags(p, std::get<0>(out).numel(), c10::cuda::getCurrentCUDAStream());
  return out;
}

OwnerKeys owner_keys_cuda(const at::Tensor& ids, const c10::optional<at::Tensor>& weights, const at::Tensor& first_id,
                          const c10::optional<at::Tensor>& first_weight, const at::Tensor& offsets,
                          const at::Tensor& feature_base, const at::Tensor& config, int64_t capacity) {
  const c10::cuda::CUDAGuard guard(offsets.device());
  OwnerKeys out;
  const OwnerKeysParams p =
      owner_keys_params(ids, weights, first_id, first_weight, offsets, feature_base, config, capacity, out);
  launch_owner_keys(p, ids.scalar_type() == at::kLong, feature_base.scalar_type() == at::kLong,
                    c10::cuda::getCurrentCUDAStream());
  return out;
}

// The pairs in buffers of their own, the sort's scratch freed (in stream order) before a weighted sort's values
// are unpacked into fresh outputs, as the schema says.
OwnerKeys sort_owner_keys_cuda(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw,
                               int64_t key_limit, const c10::optional<at::Tensor>& count) {
  check_sort_inputs(keys, bags, psw, key_limit, count);
  PGAS_CHECK(keys.numel() < (int64_t{1} << 31), "sort_owner_keys: %lld keys exceed the sort's int32 counters",
             static_cast<long long>(keys.numel()));
  const c10::cuda::CUDAGuard guard(keys.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = keys.numel();
  const bool weighted = psw.numel() > 0;
  const auto value_opts = keys.options().dtype(weighted ? at::kLong : at::kInt);
  const at::Tensor sorted[2] = {at::empty_like(keys), at::empty_like(keys)};
  const at::Tensor values[2] = {at::empty({n}, value_opts), at::empty({n}, value_opts)};
  const int64_t* counted = count.has_value() ? count->data_ptr<int64_t>() : nullptr;
  const SortPairs pairs{keys.data_ptr(), bags.data_ptr<int32_t>(), weighted ? psw.data_ptr<float>() : nullptr,
                        counted, n, key_limit, keys.scalar_type() == at::kLong,
                        {sorted[0].data_ptr(), sorted[1].data_ptr()}, {values[0].data_ptr(), values[1].data_ptr()}};
  int result = 0;  // the buffer of sorted / values that holds the sorted pairs
  {
    std::vector<at::Tensor> scratch_tensors;
    result = launch_sort_pairs(pairs, [&](size_t bytes) {
      scratch_tensors.push_back(at::empty({static_cast<int64_t>(bytes)}, keys.options().dtype(at::kByte)));
      return scratch_tensors.back().data_ptr();
    }, stream);
  }
  if (!weighted) return {sorted[result], values[result], at::empty({0}, psw.options())};
  at::Tensor out_bags = at::empty_like(bags), out_psw = at::empty_like(psw);
  launch_unpack_values(reinterpret_cast<const uint64_t*>(values[result].data_ptr()), counted, n,
                       out_bags.data_ptr<int32_t>(), out_psw.data_ptr<float>(), stream);
  return {sorted[result], out_bags, out_psw};
}

OwnerKeys sort_owner_keys_meta(const at::Tensor& keys, const at::Tensor& bags, const at::Tensor& psw, int64_t,
                               const c10::optional<at::Tensor>&) {
  return {at::empty_like(keys), at::empty_like(bags), at::empty_like(psw)};
}

}  // namespace torchrec_pgas
