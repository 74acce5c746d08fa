// pgas_row_wise and pgas_table_wise on the GPU: parameters and helpers shared by
// the three stage kernels.
//
// Table-wise is the one-owner case of row-wise: a TW table is one row block of
// N rows held by its owner (RwFeature: block = N, owner_base = the owner,
// owner_count = 1), where a RW table is W blocks of ceil(N/W) rows on ranks
// 0..W-1. The same kernels run both; an owner's lookup serves only the
// feature range it holds (cfg), and the finalize reads the blocks of the
// owners of each column (one for TW: a copy; W for RW: a sum).
//
// Symmetric buffer (same on every rank; torchrec_pgas/layout.py is the source
// of truth for the offsets, passed in as RwParams):
//
//   index region   [slot][src] blocks, written by requester `src`
//     header   int64[4]         epoch, local batch B, nnz, reserved
//     offsets  int64[F*Bmax+1]  where bag fb's ids start in this owner's ids
//     lengths  int32[F*Bmax]    ids of bag fb that this owner holds
//     ids      row_t[C]         local rows; the ids of a tile of <= 32 bags that this
//                               owner holds, packed in bag order at the start of the
//                               tile's span in the requester's own CSR values;
//                               row_t = int32 unless a shard has >= 2^31 rows (id_bytes)
//     weights  float[C]         per-sample weights (weighted only)
//   output region  [slot][owner] blocks, written by owner `owner`
//     partial  out_t[Bmax][D]   the owner's partial pool of every bag, final layout
//
// slot = epoch % num_slots. Signal pad (int64): [0] abort word, [1..31] abort
// reason, then 2W epoch slots: index slot `src` (requester -> owner) and
// output slot `W + owner` (owner -> requester).
//
// Synchronization protocol, one step = three kernels on the current stream:
//   index_dist (requester): every CTA stores ids/lengths/offsets straight into
//     each owner's index block through NVLink peer pointers, then
//     fence.sc.sys + atomicAdd on a local done counter; the last CTA stores
//     the epoch into every owner's index slot (st.release.sys).
//   lookup (owner): CTA (x, k) serves source (rank + 1 + k) % W, so remote
//     sources are scheduled first and the local one last; thread 0 spins
//     (ld.acquire.sys) on that source's index slot, the CTA pools its share of
//     the bags and stores each partial vector into the requester's output
//     block; the last CTA of the source fences and stores the epoch into the
//     requester's output slot.
//   finalize (requester): thread 0 waits for this rank's lookup to end (its
//     last CTA releases state[kCtrLookup]), W threads spin on the W output
//     slots, then the CTA sums the partials in rank order (and divides MEAN
//     bags) into the output.
// The lookup and the finalize are launched to start once the CTAs of the
// kernel before them have exited, not once that grid has completed
// (launch_after_exit): they read nothing of it except through these signals.
// Each stage keeps a device-side epoch counter (state[kCtr*]), read by every
// CTA at entry and advanced by the stage's last CTA. No host value changes
// between steps, so the three launches can be captured in a CUDA graph. Waits give up after `timeout_ns` or when the
// pad's abort word is set (checked again once the signal has arrived); errors
// go to a device record that finalize copies to pinned host memory. A rank
// that skips a source's data aborts that source before signalling it.
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pgas_common.cuh"

namespace torchrec_pgas {

constexpr int kPadHeaderWords = 32;  // runtime.PAD_HEADER_WORDS
constexpr int kCfgEntries = 22;  // the layout config list (layout.py: RwLayout.kernel_config)
constexpr int kMaxWorld = 64;
constexpr float kMeanEps = 1e-6f;  // TorchRec's RW mean divisor guard

enum WeightDtype : int32_t { kF32 = 0, kF16 = 1 };
// Row-wise MEAN divides the summed partials by length + 1e-6 on the requester
// (TorchRec RW); table-wise MEAN is the owner's TBE arithmetic, sum * (1.f / L).
enum MeanMode : int32_t { kMeanNone = 0, kMeanRequester = 1, kMeanOwner = 2 };
enum BoundsMode : int32_t { kBoundsFatal = 0, kBoundsWarning = 1, kBoundsIgnore = 2 };

// Error codes of the device error record (torchrec_pgas/sharding/rw_pipeline.py decodes them).
enum ErrorCode : int64_t {
  kErrNone = 0,
  kErrBadId = 1,  // a: feature, b: id                       (FATAL)
  kErrBatchMismatch = 2,  // a: src rank, b: its B, c: this B
  kErrTimeout = 3,  // a: stage (0 index, 1 lookup, 2 finalize), b: peer
  kErrPeerAbort = 4,  // a: aborting rank
  kErrCorrupt = 5,  // a: src rank, b: what (0 header, 1 span, 2 row)
  kErrBadIdWarn = 6,  // a: feature, b: id                  (WARNING, replaced by 0)
};

// state[] words: per-stage epoch counters, per-stage done counters, the error
// record, then one done counter per source for the lookup.
enum StateWord : int {
  kCtrIndex = 0,
  kCtrLookup = 1,  // released by the lookup's last CTA: the finalize waits for it
  kTileClaims = 2,  // index_dist: tiles claimed so far this step (reset by its last CTA)
  kDoneIndex = 3,
  kDoneLookup = 4,
  kDoneFinal = 5,
  kCtrFinal = 6,
  kErrCode = 8,  // kErrCode..kErrCode+3: code, a, b, c
  // Opt-in comm timeline (DevicePipeline.trace_comm, cfg `trace` selects the
  // kernels' kTrace builds): int64 [cap][2] records of (globaltimer ns,
  // cumulative bytes this rank stored into peers' memory), one per `step` bytes.
  kTraceBuf = 12,
  kTraceStep = 13,
  kTraceCap = 14,
  kTraceBytes = 15,
  kDoneSrc = 16,  // + k for the k-th source of the lookup grid
  kBagClaims = 16 + kMaxWorld,  // + k: lookup, units of bags of source k claimed so far (reset by its last CTA)
  kStateWords = 16 + 2 * kMaxWorld,
};

// One row per feature of the sharding, in sharding feature order (int64[kFeatureWords]).
struct RwFeature {
  int64_t weights;  // address of this rank's shard of the table: [local_rows][dim]
  int64_t local_rows;
  int64_t block;  // ceil(N / W): rows per owner
  int64_t hash_size;  // N
  int64_t dim;
  int64_t out_col;  // first column in the [B, D] output
  int64_t dtype;  // WeightDtype
  int64_t is_mean;  // MeanMode
  int64_t block_magic;  // id / block == (id * magic) >> shift for ids < 2^31; 0 if N >= 2^31
  int64_t block_shift;  // (layout.py: divisor_magic)
  int64_t owner_base;  // row block k of the table lives on rank owner_base + k
  int64_t owner_count;  // W (row-wise) or 1 (table-wise)
  int64_t input_feature;  // where the local KJT holds this feature's bags (its own index unless permuted)
};
constexpr int kFeatureWords = sizeof(RwFeature) / sizeof(int64_t);

struct RwParams {
  uint8_t* buf;  // this rank's symmetric buffer
  int64_t* pad;  // this rank's signal pad
  const int64_t* peer_bufs;  // [W] addresses of every rank's buffer (nvshmem_ptr)
  const int64_t* peer_pads;  // [W] addresses of every rank's pad
  const RwFeature* features;  // [F]
  int64_t* state;  // [kStateWords] device scratch
  float* bag_div;  // [num_slots][F*Bmax] MEAN divisors of this rank's bags
  int64_t* status;  // [4] pinned host mirror of the error record
  // layout (bytes)
  int64_t index_block_bytes, output_region_off, output_block_bytes;
  int64_t offsets_off, lengths_off, ids_off, weights_off;
  int64_t num_slots, max_batch, capacity, dim_sum, num_features;
  int64_t timeout_ns;
  int32_t rank, world, weighted, bounds_mode, id_bytes;
  int32_t lookup_f_lo, lookup_f_hi;  // the features whose rows this rank holds
  int32_t variable_batch;  // 1: each source's batch comes from its header (TW)
  int32_t trace;  // 1: launch the comm-timeline builds of the kernels
  int64_t batch, nnz;  // this step, this rank
};

__device__ __forceinline__ int64_t index_block(const RwParams& p, int64_t slot, int src) {
  return (slot * p.world + src) * p.index_block_bytes;
}

__device__ __forceinline__ int64_t output_block(const RwParams& p, int64_t slot, int owner) {
  return p.output_region_off + (slot * p.world + owner) * p.output_block_bytes;
}

__device__ __forceinline__ void st_release_sys(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Which record a step keeps: a cause beats a consequence. A WARNING-mode bad id
// must not hide anything; a peer's abort (the consequence of that peer's own
// error) gives way to an error this rank finds itself, e.g. both ranks of a
// batch mismatch abort each other, and each must still report the mismatch.
__device__ __forceinline__ int error_rank(unsigned long long code) {
  return code == kErrNone ? -1 : code == kErrBadIdWarn ? 0 : code == kErrPeerAbort ? 1 : 2;
}

// Finalize copies the record to the host.
__device__ __forceinline__ void record_error(const RwParams& p, int64_t code, int64_t a,
                                             int64_t b = 0, int64_t c = 0) {
  unsigned long long* word = reinterpret_cast<unsigned long long*>(p.state + kErrCode);
  const unsigned long long mine = static_cast<unsigned long long>(code);
  unsigned long long old = *reinterpret_cast<volatile unsigned long long*>(word);
  while (error_rank(old) < error_rank(mine)) {
    const unsigned long long seen = atomicCAS(word, old, mine);
    if (seen == old) {
      p.state[kErrCode + 1] = a;
      p.state[kErrCode + 2] = b;
      p.state[kErrCode + 3] = c;
      return;
    }
    old = seen;
  }
}

// Spin until *slot >= epoch. False (and an error recorded) on timeout or abort.
// The abort word is checked once more after the signal arrived: a peer that
// gave up on this rank's data aborts first and signals after (release order),
// so its signal must not make stale data look complete.
__device__ __forceinline__ bool wait_epoch(const RwParams& p, const int64_t* slot, int64_t epoch,
                                           int stage, int peer) {
  const uint64_t start = global_timer_ns();
  while (ld_acquire_sys(slot) < epoch) {
    if (ld_volatile(p.pad) != 0) break;
    if (global_timer_ns() - start > static_cast<uint64_t>(p.timeout_ns)) {
      record_error(p, kErrTimeout, stage, peer);
      return false;
    }
  }
  const int64_t abort_word = ld_volatile(p.pad);
  if (abort_word != 0) {
    record_error(p, kErrPeerAbort, abort_word - 1);
    return false;
  }
  return true;
}

// Tell `peer` this rank gave up on the step (its waits then fail fast).
__device__ __forceinline__ void abort_peer(const RwParams& p, int peer) {
  int64_t* peer_pad = reinterpret_cast<int64_t*>(p.peer_pads[peer]);
  st_release_sys(peer_pad, p.rank + 1);
}

// Last-CTA pattern: true in exactly one thread of the last CTA to arrive.
// Call from thread 0 after __syncthreads(); the fence publishes this CTA's
// stores (peer stores included) before the count.
__device__ __forceinline__ bool last_to_arrive(int64_t* counter, int64_t arrivals) {
  __threadfence_system();
  const unsigned long long old = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);
  if (old + 1 != static_cast<unsigned long long>(arrivals)) return false;
  *counter = 0;  // stream order: the next launch starts after this one ends
  __threadfence_system();
  return true;
}

// ---- 4-element vectors: every row, column block and output is a multiple of 4 ----

__device__ __forceinline__ float4 half4_to_float4(uint2 raw) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ float4 bf16x4_to_float4(uint2 raw) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// L2-only loads (ld.global.cg) for data a peer wrote during this kernel's life.
__device__ __forceinline__ float4 load4_cg(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ float4 load4_cg(const c10::Half* p) {
  return half4_to_float4(__ldcg(reinterpret_cast<const uint2*>(p)));
}
__device__ __forceinline__ float4 load4_cg(const c10::BFloat16* p) {
  return bf16x4_to_float4(__ldcg(reinterpret_cast<const uint2*>(p)));
}

__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

__device__ __forceinline__ void store4(c10::Half* p, float4 v) {
  __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
}

__device__ __forceinline__ void store4(c10::BFloat16* p, float4 v) {
  __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
}

__device__ __forceinline__ void fma4(float4& acc, float w, float4 x) {
  acc.x += w * x.x;
  acc.y += w * x.y;
  acc.z += w * x.z;
  acc.w += w * x.w;
}

// Comm timeline (opt-in): add `bytes` stored into peers' memory; a record per
// `step` bytes crossed. Out of line: the hot loops pay one uniform branch.
__device__ __noinline__ inline void trace_remote_bytes(int64_t* state, int64_t bytes) {
  int64_t* trace = reinterpret_cast<int64_t*>(state[kTraceBuf]);
  const int64_t step = state[kTraceStep], cap = state[kTraceCap];
  const int64_t old = static_cast<int64_t>(
      atomicAdd(reinterpret_cast<unsigned long long*>(state + kTraceBytes), static_cast<unsigned long long>(bytes)));
  const int64_t k = (old + bytes) / step;
  if (k > old / step && k < cap) {
    trace[2 * k] = static_cast<int64_t>(global_timer_ns());
    trace[2 * k + 1] = old + bytes;
  }
}

}  // namespace torchrec_pgas
