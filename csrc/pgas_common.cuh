// Shared helpers of the torchrec-pgas CUDA extension.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "pgas_check.h"

namespace torchrec_pgas {

// Acquire load at system scope: a peer's signal store is followed by reads of
// the data it published, so the data loads must not be hoisted above it.
__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* p) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int64_t ld_volatile(const int64_t* p) {
  return *reinterpret_cast<const volatile int64_t*>(p);
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The current device's SMs.
inline int device_sms() {
  int device = 0, sms = 0;
  PGAS_CUDA_CHECK(cudaGetDevice(&device));
  PGAS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// CTAs of `kernel` that fit on the current device at once. The stage kernels
// split their work evenly over a grid-stride loop, so a grid must not exceed
// this: one CTA more would run its whole share after the first wave finished.
template <typename Kernel>
int resident_ctas(Kernel kernel, int threads, int dynamic_smem = 0) {
  int per_sm = 0;
  PGAS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem));
  const int ctas = per_sm * device_sms();
  return ctas > 1 ? ctas : 1;
}

// Launches `kernel` so that its CTAs may start once every CTA of the kernel
// before it on the stream has exited (programmatic dependent launch), instead
// of after that grid completes. A grid completes only when its memory
// operations have: for a stage kernel whose NVLink stores are still draining
// into a peer, that is tens of microseconds with no CTA on any SM. Only for
// kernels that read nothing of their predecessor's except through the acquire
// of a signal it releases (the stage protocol of step_protocol.cuh); the next
// plain launch on the stream still waits for both grids. Stream capture keeps
// the relaxed edge in the graph. `allowed` false, or TORCHREC_PGAS_PDL=0:
// launched in stream order.
template <typename... Params, typename... Args>
void launch_after_exit(bool allowed, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args&&... args) {
  static const bool relaxed = [] {
    const char* v = std::getenv("TORCHREC_PGAS_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = allowed && relaxed ? 1 : 0;
  PGAS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace torchrec_pgas
