// The owner update's inputs: the kept bags read from the owner's buffer, the
// row keys of one TBE's kept ids (at a captured step's fixed capacity, or at
// an eager step's id count), then their stable sort. One algorithm, written
// once (write_kept_bag, bag_span, read_position, write_position, pad_position,
// clamped_key): owner_keys.cu runs it on the GPU (a thread per kept bag; a
// warp per 32 bags' keys; CUB's onesweep radix sort of the positions a device
// word counts, counted_sort.cuh), owner_keys_host.cpp on the CPU.
//
// The kept bags (kept_bags; ReceivedBlocks.kept_ids reads them too): bag i of the
// bags read (feature-major, then source, then sample; KeptBagsConfig) is
// sample b of feature f in source s's index block at slot_base + s *
// index_block_bytes. Its id count is the block's length of bag f * batch + b
// (batch: the source's, clamped to [0, max_batch]; 0 past it, where `whole`
// is false, or negative), and its ids and weights start at the block's start
// of that bag plus where the block's ids (weights) begin, in elements. A read
// that does not lie inside the buffer, aligned, reads 0: a header or slot
// decides only what is read, never where anything is written.
//
// Inputs: the owner's buffer as ids (`ids`, int32 or int64 by the step's
// layout) and as fp32 weights, and the sharding's kept bags (ReceivedBlocks.kept_ids_padded,
// computed on the device: no host sync): each bag's id count as offsets[b + 1]
// - offsets[b], and where its ids and weights start in the buffer (first_id[b],
// first_weight[b], in elements). The TBE's bags are [first_bag, end_bag) of
// them, feature-major with `stride` bags a feature; feature_base[f] is the key
// of row 0 of feature f's table (int32 or int64: the key dtype).
//
// Output, `capacity` positions: position offsets[b] - offsets[first_bag] + j
// holds bag b's j-th id as key = feature_base[f] + id, its bag numbered from the
// TBE's first (b - first_bag) and its per-sample weight; the positions after
// the TBE's ids are not written (the sort and the update stop at their count,
// offsets[end_bag] - offsets[first_bag]: no work follows the capacity). An id
// outside [0, key_limit - feature_base[f]) (its table's and the ones after
// it: the update checks the table) becomes padding (key_limit, bag -1, weight
// 0, which the update's walk never reaches), as does any read outside the
// buffer: the sources' headers decide the offsets and the reads, so every
// position written lies in [0, capacity) and every element read in the
// buffer, whatever they say (offsets that decrease make bags overlap: a
// position then holds one of their writes, memory-safe but meaningless; the
// kept bags' offsets are a sum of lengths clamped to >= 0, so theirs never
// do, and the work is a warp per 32 bags and the ids).
//
// The sort: keys outside [0, key_limit] become key_limit, then a stable radix
// sort over the key_limit's bits carries each key's bag and weight: a row's
// ids stay in arrival order (as torch.sort(stable=True) leaves them). With a
// count (a device word) it reads, sorts and writes only that many positions.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "pgas_check.h"
#include "step_abi.h"

#if defined(__CUDACC__)
#define PGAS_KEYS_FN __device__ __forceinline__
#else
#define PGAS_KEYS_FN inline
#endif

namespace torchrec_pgas {

struct KeptBagsParams {
  const uint8_t* buffer;
  int64_t buffer_bytes;
  const int64_t* slot_base;  // one word: the slot's first index block, in bytes
  const int64_t* batches;  // [world]
  const bool* whole;  // one word, or null: false keeps no bag's ids (a failed step)
  KeptBagsConfig config;
  int64_t* lengths;  // [num_features * world * rows]
  int64_t* first_id;
  int64_t* first_weight;  // null: unweighted
};

struct OwnerKeysParams {
  const void* ids;  // id_t elements
  int64_t num_ids;
  const float* weights;  // null: unweighted
  int64_t num_weights;
  const int64_t* first_id;
  const int64_t* first_weight;  // null: unweighted
  const int64_t* offsets;
  const void* feature_base;  // key_t elements
  OwnerKeysConfig config;
  int64_t capacity;  // positions: the TBE's kept ids (written), then unused ones (not written)
  void* keys;  // key_t [capacity]
  int32_t* bags;
  float* psw;  // null: unweighted
};

// x clamped to [lo, hi].
PGAS_KEYS_FN int64_t clamped(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

// Offsets and buffer starts are clamped to +-2^61 before any sum: whatever a header says, no sum below
// overflows, and a clamped value lands outside the capacity or the buffer as the true one would.
constexpr int64_t kFar = int64_t{1} << 61;

PGAS_KEYS_FN int64_t offset_at(const OwnerKeysParams& p, int64_t b) { return clamped(p.offsets[b], -kFar, kFar); }

// The T at byte `at` of the buffer, or 0 where it does not lie inside it, aligned.
template <typename T>
PGAS_KEYS_FN T buffer_word(const KeptBagsParams& p, int64_t at) {
  constexpr int64_t kBytes = sizeof(T);
  const bool inside = at >= 0 && at <= p.buffer_bytes - kBytes && at % kBytes == 0;
  return inside ? *reinterpret_cast<const T*>(p.buffer + at) : T{0};
}

// x / d rounded down (d > 0), as Python's //.
PGAS_KEYS_FN int64_t floor_div(int64_t x, int64_t d) { return x >= 0 ? x / d : -((-x + d - 1) / d); }

PGAS_KEYS_FN void write_kept_bag(const KeptBagsParams& p, int64_t i) {
  const KeptBagsConfig& c = p.config;
  const int64_t b = i % c.rows, src = i / c.rows % c.world, f = c.first_feature + i / (c.rows * c.world);
  const int64_t block = clamped(*p.slot_base, -kFar, kFar) + src * c.index_block_bytes;
  const int64_t batch = clamped(p.batches[src], 0, c.max_batch);
  const bool valid = b < batch && (p.whole == nullptr || *p.whole);
  const int64_t bag = valid ? f * batch + b : 0;
  const int64_t length = valid ? buffer_word<int32_t>(p, block + c.lengths_off + 4 * bag) : 0;
  const int64_t start = clamped(buffer_word<int64_t>(p, block + c.offsets_off + 8 * bag), -kFar, kFar);
  p.lengths[i] = length < 0 ? 0 : length;
  p.first_id[i] = start + floor_div(block + c.ids_off, c.id_bytes);
  if (p.first_weight != nullptr) p.first_weight[i] = start + floor_div(block + c.weights_off, 4);
}

template <typename key_t>
PGAS_KEYS_FN void pad_position(const OwnerKeysParams& p, int64_t q) {
  static_cast<key_t*>(p.keys)[q] = static_cast<key_t>(p.config.key_limit);
  p.bags[q] = -1;
  if (p.psw != nullptr) p.psw[q] = 0.f;
}

// Where bag b's ids go: positions [q_lo, q_hi) relative to the TBE's first, those of [offsets[b],
// offsets[b + 1]) inside the capacity; position q holds buffer element id_shift + q (its weight: weight_shift + q),
// as key base + id.
struct BagSpan {
  int64_t q_lo, q_hi, id_shift, weight_shift, base;
};

template <typename key_t>
PGAS_KEYS_FN BagSpan bag_span(const OwnerKeysParams& p, int64_t b) {
  const OwnerKeysConfig& c = p.config;
  const int64_t first = offset_at(p, c.first_bag), at = offset_at(p, b) - first, end = offset_at(p, b + 1) - first;
  BagSpan s;
  s.q_lo = clamped(at, 0, p.capacity);
  s.q_hi = clamped(end, s.q_lo, p.capacity);
  s.id_shift = clamped(p.first_id[b], -kFar, kFar) - at;
  s.weight_shift = p.psw != nullptr ? clamped(p.first_weight[b], -kFar, kFar) - at : 0;
  s.base = static_cast<const key_t*>(p.feature_base)[(b - c.first_bag) / c.stride];
  return s;
}

// What position q of a bag (q in its span s) reads: its id, -1 where the element lies outside the buffer, and its
// per-sample weight (0 outside the buffer; unread where unweighted).
struct PositionRead {
  int64_t id;
  float weight;
};

template <typename id_t>
PGAS_KEYS_FN PositionRead read_position(const OwnerKeysParams& p, const BagSpan& s, int64_t q) {
  const int64_t src = s.id_shift + q, w = s.weight_shift + q;
  PositionRead r{src >= 0 && src < p.num_ids ? static_cast<int64_t>(static_cast<const id_t*>(p.ids)[src]) : -1, 0.f};
  if (p.psw != nullptr && w >= 0 && w < p.num_weights) r.weight = p.weights[w];
  return r;
}

// Position q of bag b: its key, bag and weight, or padding where its id was not read or lies outside
// [0, key_limit - base).
template <typename key_t>
PGAS_KEYS_FN void write_position(const OwnerKeysParams& p, const BagSpan& s, int64_t b, int64_t q,
                                 const PositionRead& r) {
  const OwnerKeysConfig& c = p.config;
  if (r.id < 0 || r.id >= c.key_limit - s.base) {
    pad_position<key_t>(p, q);
    return;
  }
  static_cast<key_t*>(p.keys)[q] = static_cast<key_t>(s.base + r.id);
  p.bags[q] = static_cast<int32_t>(b - c.first_bag);
  if (p.psw != nullptr) p.psw[q] = r.weight;
}

// Bag b's ids (the CPU path: one writer a bag, in position order).
template <typename id_t, typename key_t>
PGAS_KEYS_FN void write_bag_keys(const OwnerKeysParams& p, int64_t b) {
  const BagSpan s = bag_span<key_t>(p, b);
  for (int64_t q = s.q_lo; q < s.q_hi; ++q) write_position<key_t>(p, s, b, q, read_position<id_t>(p, s, q));
}

// A key as the sort orders it: outside [0, key_limit] it is key_limit (padding).
template <typename key_t>
PGAS_KEYS_FN key_t clamped_key(key_t key, int64_t key_limit) {
  return key < 0 || static_cast<int64_t>(key) > key_limit ? static_cast<key_t>(key_limit) : key;
}

// The GPU launches (owner_keys.cu) on `stream`, their arguments checked by the ops that call them
// (owner_keys_host.cpp). Raw pointers only: the kernel file includes no tensor header.
void launch_owner_keys(const OwnerKeysParams& p, bool ids64, bool keys64, cudaStream_t stream);
void launch_kept_bags(const KeptBagsParams& p, int64_t n, cudaStream_t stream);

// The sort's pairs: keys (int32 or int64 as `keys64`) and values (a bag, or with per-sample weights a bag and its
// weight's bits packed in 64 bits, bag low), each in two buffers of n the passes ping-pong between.
struct SortPairs {
  const void* keys;
  const int32_t* bags;
  const float* psw;  // null: unweighted
  const int64_t* count;  // a device word: sort its first positions only; null: all n
  int64_t n, key_limit;
  bool keys64;
  void* sorted_keys[2];
  void* values[2];
};

// Sorts the pairs by their clamped keys (a stable radix sort over the key limit's bits), the scratch it needs
// from `scratch(bytes)` (the host's allocator, freed after the call in stream order). Returns which buffer of
// sorted_keys / values holds the result.
int launch_sort_pairs(const SortPairs& s, const std::function<void*(size_t)>& scratch, cudaStream_t stream);

// A weighted sort's values unpacked into its bags and weights (the positions the count covers).
void launch_unpack_values(const uint64_t* values, const int64_t* count, int64_t n, int32_t* bags, float* psw,
                          cudaStream_t stream);

}  // namespace torchrec_pgas
