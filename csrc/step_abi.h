// The Python <-> CUDA contract of one PGAS step: every struct and enum that
// crosses the boundary, by name. torchrec_pgas/step_abi.py mirrors this file
// field by field; describe_step_abi() below is what both sides compare (the
// extension exports it as torch.ops.torchrec_pgas.step_abi, and a CPU test
// compiles this header to check the mirror), so a field added, removed or
// reordered on one side fails loudly instead of shifting every field after it.
//
// Plain C++ (no CUDA): the kernels include it through step_protocol.cuh.
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>

namespace torchrec_pgas {

constexpr int kMaxWorld = 64;  // ranks a step can address (peer tables, per-source counters)
constexpr int kMaxSlots = 4;  // buffer slots a step layout may have (per-slot error records)
constexpr int kAbortRankBits = 7;  // abort word = (step epoch << kAbortRankBits) | (aborting rank + 1)

// Signal pad (int64 words, one pad per sharding per rank): a control header,
// then kSignalGroups groups of W epoch slots, slot kHeaderWords + group * W + r
// for peer r (StepLayout.index_signal, ...). Unscoped: its words index the pad.
enum PadWord : int64_t {
  kAbort = 0,  // the abort word of the last step a rank gave up on; 0 while healthy
  kAbortMessage = 1,  // [1, kHeaderWords): the abort reason, UTF-8
  kHeaderWords = 32,  // the first epoch slot
};

// The groups of epoch slots, by who stores into them (r: the storing peer).
enum SignalGroup : int64_t {
  kIndexSignals = 0,  // requester r -> owner: r's index block of epoch e is complete (value e)
  kOutputSignals = 1,  // owner r -> requester: r's partial of epoch e is in the output block (e)
  kGradSignals = 2,  // requester r -> owner: r's gradient block of epoch e is complete (2e, 2e + 1: r gave up)
  kReleaseSignals = 3,  // owner r -> requester: r is done with the requester's blocks of epoch e (e)
  kSignalGroups = 4,
};

enum class WeightDtype : int64_t { kF32 = 0, kF16 = 1 };

// Row-wise MEAN divides the summed partials by length + 1e-6 on the requester
// (TorchRec RW); table-wise MEAN is the owner's TBE arithmetic, sum * (1.f / L).
enum class PoolingMode : int64_t { kSum = 0, kMeanByRequester = 1, kMeanByOwner = 2 };

// FBGEMM's BoundsCheckMode as the kernels apply it (NONE is taken as IGNORE:
// ids decide the addresses of one-sided writes).
enum class BoundsMode : int32_t { kFatal = 0, kWarning = 1, kIgnore = 2 };

// An error record's code; a, b, c say more (ErrorRecord).
enum class ErrorCode : int64_t {
  kNone = 0,
  kBadId = 1,  // a: feature, b: id (FATAL)
  kBatchMismatch = 2,  // a: source rank, b: its batch, c: this rank's
  kTimeout = 3,  // a: stage (0 index, 1 lookup, 2 combine), b: peer
  kPeerAbort = 4,  // a: aborting rank
  kCorrupt = 5,  // a: source rank, b: what (0 header, 1 span, 2 row)
  kBadIdWarn = 6,  // a: feature, b: id (WARNING; never hides another code)
};

// Status of the runtime's reference wait (put_signal.cu), pinned host words.
enum class DeviceStatus : int64_t { kOk = 0, kTimeout = 1, kPeerAbort = 2 };

// Words of the per-sharding device state (int64[kStateWords]): per-stage epoch
// counters and done counters, each slot's error record, the comm timeline.
// Unscoped: its words index the state.
enum StateWord : int64_t {
  kCtrIndex = 0,  // epoch of the last index dist
  kCtrLookup = 1,  // released by the lookup's last CTA: the combine waits for it
  kTileClaims = 2,  // index dist: tiles claimed this step (reset by its last CTA)
  kDoneIndex = 3,
  kDoneLookup = 4,
  kDoneCombine = 5,
  kCtrCombine = 6,
  kDoneGrad = 7,  // grad dist: CTAs done
  // Opt-in comm timeline (trace_comm): int64 [cap][2] records of (globaltimer
  // ns, cumulative bytes this rank stored into peers), one per kTraceStep bytes.
  kTraceBuf = 12,
  kTraceStep = 13,
  kTraceCap = 14,
  kTraceBytes = 15,
  kDoneSrc = 16,  // + k: CTAs of the lookup's k-th source done
  kBagClaims = 16 + kMaxWorld,  // + k: units of bags of the lookup's k-th source claimed
  // + 4 slot: the error record (code, a, b, c) of the step in that buffer slot, published by its combine
  kErrRecords = 16 + 2 * kMaxWorld,
  kStepFailed = kErrRecords + 4 * kMaxSlots,  // + slot: the epoch of the last step there that failed
  // + slot: the deadline of every wait of the step in that slot, set by its first wait
  // ((microseconds << kDeadlineTagBits) | epoch's low bits: step_protocol.cuh step_deadline_ns)
  kStepDeadline = kStepFailed + kMaxSlots,
  // the address of the deadline words this sharding's waits use: 0 for its own; else the model's first PGAS
  // sharding's, whose stages run before this one's on the stream (one deadline a step of the model)
  kDeadlineAt = kStepDeadline + kMaxSlots,
  kStateWords = kDeadlineAt + 1,
};

// One per feature of the sharding, in sharding feature order (device int64 words).
struct FeatureDesc {
  int64_t weights;  // address of this rank's shard of the table: [local_rows][dim], row-major
  int64_t local_rows;
  int64_t block;  // rows per owner: ceil(N / W) row-wise, N table-wise
  int64_t hash_size;  // N
  int64_t dim;
  int64_t out_col;  // first column in the [B, D] output
  WeightDtype weight_dtype;
  PoolingMode pooling;
  int64_t block_magic;  // id / block == (id * magic) >> shift for ids < 2^31; 0: divide
  int64_t block_shift;  // (layout.py: divisor_magic)
  int64_t owner_base;  // row block k of the table lives on rank owner_base + k
  int64_t owner_count;  // W (row-wise) or 1 (table-wise)
  int64_t input_feature;  // where the local KJT holds this feature's bags
};

// What does not change between steps: the symmetric buffer's layout (bytes,
// torchrec_pgas/layout.py StepLayout), its capacities, and this rank's role.
struct StepConfig {
  int64_t index_block_bytes;
  int64_t output_region_off;
  int64_t output_block_bytes;
  int64_t grad_region_off;  // [slot][src] gradient blocks, each of output_block_bytes
  int64_t offsets_off;  // within an index block
  int64_t lengths_off;
  int64_t ids_off;
  int64_t weights_off;
  int64_t num_slots;
  int64_t max_batch;
  int64_t capacity;  // ids per index block
  int64_t dim_sum;  // columns of the [B, D] output
  int64_t num_features;
  int64_t timeout_ns;  // a wait gives up after this long
  int32_t rank;
  int32_t world;
  int32_t weighted;  // per-sample weights travel with the ids
  BoundsMode bounds_mode;
  int32_t id_bytes;  // 4: local rows as int32; 8: int64
  int32_t lookup_f_lo;  // [lookup_f_lo, lookup_f_hi): the features whose rows this rank holds
  int32_t lookup_f_hi;
  int32_t variable_batch;  // 1: each source's batch comes from its header (table-wise)
  int32_t trace;  // 1: launch the comm-timeline builds of the kernels
};

// A step's error record as the combine publishes it to pinned host memory, one
// per buffer slot (the device keeps code, a, b, c at kErrRecords + 4 * slot).
struct ErrorRecord {
  int64_t epoch;  // the step it belongs to
  ErrorCode code;
  int64_t a;
  int64_t b;
  int64_t c;
};

// The owner backward's update (owner_update.h): one step of FBGEMM's exact
// optimizers, applied by the owner to the rows its sources' gradients touch.
enum class Optimizer : int64_t { kSgd = 0, kRowwiseAdagrad = 1, kAdam = 2 };

// FBGEMM's weight_decay_mode values the row-wise Adagrad update applies.
enum class WeightDecay : int64_t { kNone = 0, kL2 = 1, kDecouple = 2 };

// One per feature of a TBE, in the TBE's feature order (int64 words).
struct OwnerFeatureDesc {
  int64_t table;  // its table: the op's weights[table], momentum1[table], ...
  int64_t grad_col;  // first column of the feature in the pooled gradient
};

// An update's hyper-parameters, read on the device (fp32 words).
struct OwnerHyper {
  float lr;
  float eps;
  float beta1;
  float beta2;
  float weight_decay;
  float bias_correction1;  // Adam: 1 - beta1^t, 1 - beta2^t at iteration t
  float bias_correction2;
  float reserved;  // keeps the struct a whole number of 8-byte words
};

// Where an owner's kept bags lie in its buffer (owner_keys.h: kept_bags; the
// bytes of the config, CPU uint8): a source's index block's layout, and the
// bags read, feature-major, then source, then sample.
struct KeptBagsConfig {
  int64_t index_block_bytes;  // a slot's index blocks follow each other, one a source
  int64_t lengths_off;  // within a block: int32 bag lengths [features_per_block * max_batch]
  int64_t offsets_off;  // int64 bag starts, in elements from ids_off (and from weights_off)
  int64_t ids_off;
  int64_t weights_off;  // -1: unweighted
  int64_t id_bytes;  // 4 or 8
  int64_t max_batch;
  int64_t features_per_block;
  int64_t first_feature;  // the bags read: features [first_feature, first_feature + num_features)
  int64_t num_features;
  int64_t world;  // of every source
  int64_t rows;  // their first `rows` samples (a bag past a source's batch holds no ids)
};

// What the host decides of the keys of one TBE's kept ids (owner_keys.h; the
// bytes of the config, CPU uint8).
struct OwnerKeysConfig {
  int64_t first_bag;  // the TBE's kept bags: [first_bag, end_bag) of the sharding's kept bags
  int64_t end_bag;
  int64_t stride;  // bags per feature: the TBE's feature of kept bag b is (b - first_bag) / stride
  int64_t key_limit;  // its tables' rows: the key of padding and of ids outside every table
};

// What the host decides of an update (the bytes of the config, CPU uint8).
struct OwnerUpdateConfig {
  Optimizer optimizer;
  WeightDecay weight_decay_mode;
  int64_t mean;  // 1: MEAN pooling: an id's gradient is its bag's divided by the bag's length
  int64_t weighted;  // 1: an id's gradient is scaled by its per-sample weight
  int64_t batch;  // bags per feature: bag = feature * batch + sample
};

// describe_step_abi() writes one line per constant, enumerator, struct and
// field: "const NAME VALUE", "enum TYPE NAME VALUE", "struct NAME SIZE",
// "field STRUCT NAME OFFSET SIZE", with snprintf into a caller's buffer (no
// C++ streams or strings: the same plain C wherever the header is compiled).
struct AbiText {
  char* buf;
  size_t cap;
  size_t len;  // what the whole text needs, even past cap (the caller sizes by it)

  void line(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    const int n = std::vsnprintf(len < cap ? buf + len : nullptr, len < cap ? cap - len : 0, fmt, args);
    va_end(args);
    len += n > 0 ? static_cast<size_t>(n) : 0;
  }
};

#define PGAS_ABI_ENUM(E, V) out.line("enum " #E " " #V " %lld\n", static_cast<long long>(E::V))
#define PGAS_ABI_STRUCT(S) out.line("struct " #S " %zu\n", sizeof(S))
#define PGAS_ABI_FIELD(S, F) out.line("field " #S " " #F " %zu %zu\n", offsetof(S, F), sizeof(S::F))

inline void describe_enums(AbiText& out) {
  out.line("const kMaxWorld %d\n", kMaxWorld);
  out.line("const kMaxSlots %d\n", kMaxSlots);
  out.line("const kAbortRankBits %d\n", kAbortRankBits);
  PGAS_ABI_ENUM(PadWord, kAbort);
  PGAS_ABI_ENUM(PadWord, kAbortMessage);
  PGAS_ABI_ENUM(PadWord, kHeaderWords);
  PGAS_ABI_ENUM(SignalGroup, kIndexSignals);
  PGAS_ABI_ENUM(SignalGroup, kOutputSignals);
  PGAS_ABI_ENUM(SignalGroup, kGradSignals);
  PGAS_ABI_ENUM(SignalGroup, kReleaseSignals);
  PGAS_ABI_ENUM(SignalGroup, kSignalGroups);
  PGAS_ABI_ENUM(WeightDtype, kF32);
  PGAS_ABI_ENUM(WeightDtype, kF16);
  PGAS_ABI_ENUM(PoolingMode, kSum);
  PGAS_ABI_ENUM(PoolingMode, kMeanByRequester);
  PGAS_ABI_ENUM(PoolingMode, kMeanByOwner);
  PGAS_ABI_ENUM(BoundsMode, kFatal);
  PGAS_ABI_ENUM(BoundsMode, kWarning);
  PGAS_ABI_ENUM(BoundsMode, kIgnore);
  PGAS_ABI_ENUM(ErrorCode, kNone);
  PGAS_ABI_ENUM(ErrorCode, kBadId);
  PGAS_ABI_ENUM(ErrorCode, kBatchMismatch);
  PGAS_ABI_ENUM(ErrorCode, kTimeout);
  PGAS_ABI_ENUM(ErrorCode, kPeerAbort);
  PGAS_ABI_ENUM(ErrorCode, kCorrupt);
  PGAS_ABI_ENUM(ErrorCode, kBadIdWarn);
  PGAS_ABI_ENUM(DeviceStatus, kOk);
  PGAS_ABI_ENUM(DeviceStatus, kTimeout);
  PGAS_ABI_ENUM(DeviceStatus, kPeerAbort);
  PGAS_ABI_ENUM(StateWord, kCtrIndex);
  PGAS_ABI_ENUM(StateWord, kCtrLookup);
  PGAS_ABI_ENUM(StateWord, kTileClaims);
  PGAS_ABI_ENUM(StateWord, kDoneIndex);
  PGAS_ABI_ENUM(StateWord, kDoneLookup);
  PGAS_ABI_ENUM(StateWord, kDoneCombine);
  PGAS_ABI_ENUM(StateWord, kCtrCombine);
  PGAS_ABI_ENUM(StateWord, kDoneGrad);
  PGAS_ABI_ENUM(StateWord, kTraceBuf);
  PGAS_ABI_ENUM(StateWord, kTraceStep);
  PGAS_ABI_ENUM(StateWord, kTraceCap);
  PGAS_ABI_ENUM(StateWord, kTraceBytes);
  PGAS_ABI_ENUM(StateWord, kDoneSrc);
  PGAS_ABI_ENUM(StateWord, kBagClaims);
  PGAS_ABI_ENUM(StateWord, kErrRecords);
  PGAS_ABI_ENUM(StateWord, kStepFailed);
  PGAS_ABI_ENUM(StateWord, kStepDeadline);
  PGAS_ABI_ENUM(StateWord, kDeadlineAt);
  PGAS_ABI_ENUM(StateWord, kStateWords);
  PGAS_ABI_ENUM(Optimizer, kSgd);
  PGAS_ABI_ENUM(Optimizer, kRowwiseAdagrad);
  PGAS_ABI_ENUM(Optimizer, kAdam);
  PGAS_ABI_ENUM(WeightDecay, kNone);
  PGAS_ABI_ENUM(WeightDecay, kL2);
  PGAS_ABI_ENUM(WeightDecay, kDecouple);
}

inline void describe_structs(AbiText& out) {
  PGAS_ABI_STRUCT(FeatureDesc);
  PGAS_ABI_FIELD(FeatureDesc, weights);
  PGAS_ABI_FIELD(FeatureDesc, local_rows);
  PGAS_ABI_FIELD(FeatureDesc, block);
  PGAS_ABI_FIELD(FeatureDesc, hash_size);
  PGAS_ABI_FIELD(FeatureDesc, dim);
  PGAS_ABI_FIELD(FeatureDesc, out_col);
  PGAS_ABI_FIELD(FeatureDesc, weight_dtype);
  PGAS_ABI_FIELD(FeatureDesc, pooling);
  PGAS_ABI_FIELD(FeatureDesc, block_magic);
  PGAS_ABI_FIELD(FeatureDesc, block_shift);
  PGAS_ABI_FIELD(FeatureDesc, owner_base);
  PGAS_ABI_FIELD(FeatureDesc, owner_count);
  PGAS_ABI_FIELD(FeatureDesc, input_feature);
  PGAS_ABI_STRUCT(StepConfig);
  PGAS_ABI_FIELD(StepConfig, index_block_bytes);
  PGAS_ABI_FIELD(StepConfig, output_region_off);
  PGAS_ABI_FIELD(StepConfig, output_block_bytes);
  PGAS_ABI_FIELD(StepConfig, grad_region_off);
  PGAS_ABI_FIELD(StepConfig, offsets_off);
  PGAS_ABI_FIELD(StepConfig, lengths_off);
  PGAS_ABI_FIELD(StepConfig, ids_off);
  PGAS_ABI_FIELD(StepConfig, weights_off);
  PGAS_ABI_FIELD(StepConfig, num_slots);
  PGAS_ABI_FIELD(StepConfig, max_batch);
  PGAS_ABI_FIELD(StepConfig, capacity);
  PGAS_ABI_FIELD(StepConfig, dim_sum);
  PGAS_ABI_FIELD(StepConfig, num_features);
  PGAS_ABI_FIELD(StepConfig, timeout_ns);
  PGAS_ABI_FIELD(StepConfig, rank);
  PGAS_ABI_FIELD(StepConfig, world);
  PGAS_ABI_FIELD(StepConfig, weighted);
  PGAS_ABI_FIELD(StepConfig, bounds_mode);
  PGAS_ABI_FIELD(StepConfig, id_bytes);
  PGAS_ABI_FIELD(StepConfig, lookup_f_lo);
  PGAS_ABI_FIELD(StepConfig, lookup_f_hi);
  PGAS_ABI_FIELD(StepConfig, variable_batch);
  PGAS_ABI_FIELD(StepConfig, trace);
  PGAS_ABI_STRUCT(ErrorRecord);
  PGAS_ABI_FIELD(ErrorRecord, epoch);
  PGAS_ABI_FIELD(ErrorRecord, code);
  PGAS_ABI_FIELD(ErrorRecord, a);
  PGAS_ABI_FIELD(ErrorRecord, b);
  PGAS_ABI_FIELD(ErrorRecord, c);
  PGAS_ABI_STRUCT(OwnerFeatureDesc);
  PGAS_ABI_FIELD(OwnerFeatureDesc, table);
  PGAS_ABI_FIELD(OwnerFeatureDesc, grad_col);
  PGAS_ABI_STRUCT(OwnerHyper);
  PGAS_ABI_FIELD(OwnerHyper, lr);
  PGAS_ABI_FIELD(OwnerHyper, eps);
  PGAS_ABI_FIELD(OwnerHyper, beta1);
  PGAS_ABI_FIELD(OwnerHyper, beta2);
  PGAS_ABI_FIELD(OwnerHyper, weight_decay);
  PGAS_ABI_FIELD(OwnerHyper, bias_correction1);
  PGAS_ABI_FIELD(OwnerHyper, bias_correction2);
  PGAS_ABI_FIELD(OwnerHyper, reserved);
  PGAS_ABI_STRUCT(KeptBagsConfig);
  PGAS_ABI_FIELD(KeptBagsConfig, index_block_bytes);
  PGAS_ABI_FIELD(KeptBagsConfig, lengths_off);
  PGAS_ABI_FIELD(KeptBagsConfig, offsets_off);
  PGAS_ABI_FIELD(KeptBagsConfig, ids_off);
  PGAS_ABI_FIELD(KeptBagsConfig, weights_off);
  PGAS_ABI_FIELD(KeptBagsConfig, id_bytes);
  PGAS_ABI_FIELD(KeptBagsConfig, max_batch);
  PGAS_ABI_FIELD(KeptBagsConfig, features_per_block);
  PGAS_ABI_FIELD(KeptBagsConfig, first_feature);
  PGAS_ABI_FIELD(KeptBagsConfig, num_features);
  PGAS_ABI_FIELD(KeptBagsConfig, world);
  PGAS_ABI_FIELD(KeptBagsConfig, rows);
  PGAS_ABI_STRUCT(OwnerKeysConfig);
  PGAS_ABI_FIELD(OwnerKeysConfig, first_bag);
  PGAS_ABI_FIELD(OwnerKeysConfig, end_bag);
  PGAS_ABI_FIELD(OwnerKeysConfig, stride);
  PGAS_ABI_FIELD(OwnerKeysConfig, key_limit);
  PGAS_ABI_STRUCT(OwnerUpdateConfig);
  PGAS_ABI_FIELD(OwnerUpdateConfig, optimizer);
  PGAS_ABI_FIELD(OwnerUpdateConfig, weight_decay_mode);
  PGAS_ABI_FIELD(OwnerUpdateConfig, mean);
  PGAS_ABI_FIELD(OwnerUpdateConfig, weighted);
  PGAS_ABI_FIELD(OwnerUpdateConfig, batch);
}

#undef PGAS_ABI_ENUM
#undef PGAS_ABI_STRUCT
#undef PGAS_ABI_FIELD

// The description's length; it is written into buf when cap is larger (with a NUL).
inline size_t describe_step_abi(char* buf, size_t cap) {
  AbiText out{buf, cap, 0};
  describe_enums(out);
  describe_structs(out);
  return out.len;
}

}  // namespace torchrec_pgas
