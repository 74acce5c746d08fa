// Shared helpers of the torchrec-pgas CUDA extension.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include <c10/util/Exception.h>

#define PGAS_CUDA_CHECK(expr)                                                  \
  do {                                                                         \
    cudaError_t err__ = (expr);                                                \
    TORCH_CHECK(err__ == cudaSuccess, "CUDA error: ", cudaGetErrorString(err__), \
                " at ", __FILE__, ":", __LINE__);                              \
  } while (0)

namespace torchrec_pgas {

// Status words the device writes into pinned host memory; the host reads them
// after the stream is synchronized (see PgasRuntime.check()).
enum DeviceStatus : int64_t {
  kStatusOk = 0,
  kStatusTimeout = 1,  // a waited-for signal did not arrive in time
  kStatusPeerAbort = 2,  // a peer set the abort word of the pad
};

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

// CTAs of `kernel` that fit on the current device at once. The stage kernels
// split their work evenly over a grid-stride loop, so a grid must not exceed
// this: one CTA more would run its whole share after the first wave finished.
template <typename Kernel>
int resident_ctas(Kernel kernel, int threads, int dynamic_smem = 0) {
  int per_sm = 0, device = 0, sms = 0;
  PGAS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem));
  PGAS_CUDA_CHECK(cudaGetDevice(&device));
  PGAS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return per_sm * sms > 1 ? per_sm * sms : 1;
}

}  // namespace torchrec_pgas
