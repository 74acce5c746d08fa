// The device protocol of one PGAS step (pgas_row_wise and pgas_table_wise):
// the symmetric buffer's layout, the synchronization between the three stage
// kernels, and the helpers they share. The typed contract with Python (the
// structs and enums named here) is step_abi.h.
//
// Table-wise is the one-owner case of row-wise: a TW table is one row block of
// N rows held by its owner (FeatureDesc: block = N, owner_base = the owner,
// owner_count = 1), where a RW table is W blocks of ceil(N/W) rows on ranks
// 0..W-1. The same kernels run both; an owner's lookup serves only the
// feature range it holds (StepConfig::lookup_f_lo/hi), and the combine reads
// the blocks of the owners of each column (one for TW: a copy; W for RW: a sum).
//
// Symmetric buffer (same on every rank; torchrec_pgas/layout.py StepLayout is the
// source of truth for the offsets, passed in as StepConfig):
//
//   index region   [slot][src] blocks, written by requester `src`
//     header   int64[4]         epoch, local batch B, nnz, 1 if `src` gave the step up
//     offsets  int64[F*Bmax+1]  where bag fb's ids start in this owner's ids
//     lengths  int32[F*Bmax]    ids of bag fb that this owner holds
//     ids      row_t[C]         local rows; the ids of a tile of <= 32 bags that this
//                               owner holds, packed in bag order at the start of the
//                               tile's span in the requester's own CSR values;
//                               row_t = int32 unless a shard has >= 2^31 rows (id_bytes)
//     weights  float[C]         per-sample weights (weighted only)
//   output region  [slot][owner] blocks, written by owner `owner`
//     partial  out_t[Bmax][D]   the owner's partial pool of every bag, final layout
//   gradient region [slot][src] blocks, written by requester `src` in its
//     backward (trainable layouts only; grad_exchange.cu)
//     gradient out_t[Bmax][D]   rows of the bags this owner held ids of
//
// slot = epoch % num_slots: 3 slots when training (a step's index block stays
// until its backward; TorchRec's pipelines keep up to three steps in flight),
// else 2. Signal pad (int64, PadWord): [0] abort word ((epoch << 7) | rank + 1
// of the last step a rank gave up: aborts are per step, the next step runs),
// [1..31] abort reason, then 4W epoch slots (SignalGroup): index `src`
// (requester -> owner), output `owner` (owner -> requester), gradient `src`
// (2e, or 2e + 1 if the source gave the step's backward up) and release
// `owner` (the owner is done with this requester's blocks of step e).
//
// Synchronization protocol, one step = three kernels on the current stream:
//   index_dist (requester): in every CTA, threads 0..W-1 wait until every
//     owner has released this slot's previous step (epoch - num_slots; an
//     abort does not end this wait; on a timeout the step fails and its owners
//     are aborted);
//     every CTA stores ids/lengths/offsets straight into
//     each owner's index block through NVLink peer pointers, then
//     fence.sc.sys + atomicAdd on a local done counter; the last CTA stores
//     the epoch into every owner's index slot (st.release.sys).
//   pooled_lookup (owner): CTA (x, k) serves source (rank + 1 + k) % W, so remote
//     sources are scheduled first and the local one last; thread 0 spins
//     (ld.acquire.sys) on that source's index slot, the CTA pools its share of
//     the bags and stores each partial vector into the requester's output
//     block; the last CTA of the source fences and stores the epoch into the
//     requester's output slot.
//   combine_partials (requester): thread 0 waits for this rank's lookup to end
//     (its last CTA releases state[kCtrLookup]), W threads spin on the W output
//     slots, then the CTA sums the partials in rank order (and divides MEAN
//     bags) into the output.
// The lookup and the combine are launched to start once the CTAs of the
// kernel before them have exited, not once that grid has completed
// (launch_after_exit): they read nothing of it except through these signals.
// Each stage keeps a device-side epoch counter (state[kCtr*]), read by every
// CTA at entry and advanced by the stage's last CTA. No host value changes
// between steps, so the three launches can be captured in a CUDA graph. The
// forward's waits give up after `timeout_ns` or when the pad's abort word is
// set (checked again once the signal has arrived); the backward's await_grads
// gives up after `timeout_ns` only (a source that gives the backward up says so
// in its grad signal). Errors go to the state's ErrorRecord, which the
// combine copies to pinned host memory (DeviceStep decodes it). A rank that
// skips a source's data aborts that source before signalling it. A rank that
// gives a step up (bad input seen on the host, or owners not released)
// publishes its index blocks empty, with header[3] = 1 (its last CTA; a host
// give-up only once the owners released the slot), so every epoch stays in
// step; kStepFailed[slot] = epoch marks a failed step, and its
// backward (grad_exchange.cu) applies nothing on any rank. Without a backward
// (inference, eval) the lookup releases each source once served. Backwards
// run in the order of their forwards (autograd's order for one loss per step):
// a grad signal holds the newest epoch sent, so an owner awaiting step e takes
// a signal of a later step as e's.
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pgas_common.cuh"
#include "step_abi.h"
#include "step_params.h"

namespace torchrec_pgas {

constexpr float kMeanEps = 1e-6f;  // TorchRec's RW mean divisor guard

__device__ __forceinline__ int64_t index_block(const StepParams& p, int64_t slot, int src) {
  return (slot * p.world + src) * p.index_block_bytes;
}

__device__ __forceinline__ int64_t output_block(const StepParams& p, int64_t slot, int owner) {
  return p.output_region_off + (slot * p.world + owner) * p.output_block_bytes;
}

__device__ __forceinline__ void st_release_sys(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The epoch slot of `group` that peer r stores into, in this rank's pad.
__device__ __forceinline__ int64_t* my_signal(const StepParams& p, SignalGroup group, int r) {
  return p.pad + kHeaderWords + group * p.world + r;
}

// The epoch slot of `group` that this rank stores into, in `peer`'s pad.
__device__ __forceinline__ int64_t* peer_signal(const StepParams& p, int peer, SignalGroup group) {
  return reinterpret_cast<int64_t*>(p.peer_pads[peer]) + kHeaderWords + group * p.world + p.rank;
}

// Which record a step keeps: a cause beats a consequence. A WARNING-mode bad id
// must not hide anything; a peer's abort (the consequence of that peer's own
// error) gives way to an error this rank finds itself, e.g. both ranks of a
// batch mismatch abort each other, and each must still report the mismatch.
__device__ __forceinline__ int error_rank(ErrorCode code) {
  return code == ErrorCode::kNone ? -1 : code == ErrorCode::kBadIdWarn ? 0 : code == ErrorCode::kPeerAbort ? 1 : 2;
}

// Records an error of step `epoch` in its slot's record (the combine copies it
// to the host) and, unless a warning, marks the step failed (the backward
// reads kStepFailed: a failed step changes no weight on any rank).
__device__ __forceinline__ void record_error(const StepParams& p, int64_t epoch, ErrorCode code, int64_t a,
                                             int64_t b = 0, int64_t c = 0) {
  int64_t* record = p.state + kErrRecords + 4 * (epoch % p.num_slots);
  if (code != ErrorCode::kBadIdWarn) p.state[kStepFailed + epoch % p.num_slots] = epoch;
  unsigned long long* word = reinterpret_cast<unsigned long long*>(record);
  const unsigned long long mine = static_cast<unsigned long long>(code);
  unsigned long long old = *reinterpret_cast<volatile unsigned long long*>(word);
  while (error_rank(static_cast<ErrorCode>(old)) < error_rank(code)) {
    const unsigned long long seen = atomicCAS(word, old, mine);
    if (seen == old) {
      record[1] = a;
      record[2] = b;
      record[3] = c;
      return;
    }
    old = seen;
  }
}

// The rank that gave up on step `epoch` (its abort word in this rank's pad), or -1.
__device__ __forceinline__ int aborted_by(const StepParams& p, int64_t epoch) {
  const int64_t word = ld_volatile(p.pad + kAbort);
  return word != 0 && (word >> kAbortRankBits) == epoch ? static_cast<int>(word & ((1 << kAbortRankBits) - 1)) - 1 : -1;
}

// One deadline for every wait of a step of the model on this rank, forward and
// backward: the step's first wait sets it, timeout_ns from its start (a word a
// slot: the deadline in microseconds tagged with the epoch's low bits, claimed
// by one atomicCAS), and each later wait of the step gives up at it. The words
// are the model's first PGAS sharding's (state[kDeadlineAt]; 0: this
// sharding's own, state[kStepDeadline]): the shardings' stages run one after
// another on the stream, and every sharding of the model runs each step at the
// same epoch (a step failed in one is consumed by all). A stalled peer so
// fails the step once, timeout_ns after its first wait, whichever of the
// step's waits (release, index, outputs, gradients; of any sharding) it stalls.
constexpr int kDeadlineTagBits = 13;
constexpr unsigned long long kDeadlineTagMask = (1ull << kDeadlineTagBits) - 1;

__device__ __forceinline__ uint64_t step_deadline_ns(const StepParams& p, int64_t epoch) {
  int64_t* words = reinterpret_cast<int64_t*>(p.state[kDeadlineAt]);
  if (words == nullptr) words = p.state + kStepDeadline;
  unsigned long long* word = reinterpret_cast<unsigned long long*>(words + epoch % p.num_slots);
  const unsigned long long tag = static_cast<unsigned long long>(epoch) & kDeadlineTagMask;
  unsigned long long old = *reinterpret_cast<volatile unsigned long long*>(word);
  while ((old & kDeadlineTagMask) != tag) {
    const unsigned long long at_us = (global_timer_ns() + static_cast<uint64_t>(p.timeout_ns)) / 1000;
    const unsigned long long seen = atomicCAS(word, old, (at_us << kDeadlineTagBits) | tag);
    old = seen == old ? (at_us << kDeadlineTagBits) | tag : seen;
  }
  return (old >> kDeadlineTagBits) * 1000;
}

// How long this rank has waited in step `epoch` by `now` (from its first wait), in milliseconds.
__device__ __forceinline__ int64_t waited_ms(const StepParams& p, uint64_t deadline, uint64_t now) {
  return static_cast<int64_t>((now + static_cast<uint64_t>(p.timeout_ns) - deadline) / 1000000);
}

// Spin until *slot >= value, for step `epoch`. False (and an error recorded:
// the stage, the peer and how long the step waited) at the step's deadline or
// on an abort of this step. The abort word is checked once more
// after the signal arrived: a peer that gave up on this rank's data aborts
// first and signals after (release order), so its signal must not make stale
// data look complete. `stage`: 0 index, 1 lookup, 2 combine, 3 backward.
// `heed_abort` false: wait for the signal whatever the abort word says (the
// release of an earlier step, which an abort of this one does not replace).
__device__ __forceinline__ bool wait_epoch(const StepParams& p, const int64_t* slot, int64_t value, int64_t epoch,
                                           int stage, int peer, bool heed_abort = true) {
  const uint64_t deadline = step_deadline_ns(p, epoch);
  while (ld_acquire_sys(slot) < value) {
    if (heed_abort && aborted_by(p, epoch) >= 0) break;
    const uint64_t now = global_timer_ns();
    if (now > deadline) {
      record_error(p, epoch, ErrorCode::kTimeout, stage, peer, waited_ms(p, deadline, now));
      return false;
    }
  }
  const int by = heed_abort ? aborted_by(p, epoch) : -1;
  if (by >= 0) {
    record_error(p, epoch, ErrorCode::kPeerAbort, by);
    return false;
  }
  return true;
}

// Tell `peer` this rank gave up on step `epoch` (its waits for it then fail fast).
__device__ __forceinline__ void abort_peer(const StepParams& p, int peer, int64_t epoch) {
  int64_t* peer_pad = reinterpret_cast<int64_t*>(p.peer_pads[peer]);
  st_release_sys(peer_pad + kAbort, (epoch << kAbortRankBits) | (p.rank + 1));
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
