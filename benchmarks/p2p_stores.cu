// SM stores into a peer GPU's memory over NVLink: bandwidth by store width and
// run length, next to the copy engine and local HBM (benchmarks/archive/NOTES-2026-11.md.gz §14).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/p2p_stores.cu -o /tmp/p2p_stores && /tmp/p2p_stores
//
// Every warp writes its own contiguous slice of a 256 MiB buffer (GPU 0 -> GPU 1):
// `lanes` lanes of each warp store `width` bytes each per instruction, so a warp
// instruction covers lanes * width contiguous bytes (lanes < 32: runs shorter
// than a 128-byte line, the index dist's old pattern). Grid: `ctas` CTAs of 256.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

template <int kWidth>
struct Word;
template <>
struct Word<4> { using T = uint32_t; };
template <>
struct Word<8> { using T = uint2; };
template <>
struct Word<16> { using T = uint4; };

template <int kWidth>
__global__ void store_kernel(uint8_t* dst, int64_t bytes, int lanes) {
  using T = typename Word<kWidth>::T;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  // The warp's slice, in whole 128-byte-aligned strides of 32 * kWidth bytes;
  // only the first `lanes` lanes of a stride store (the rest of it stays unwritten).
  const int64_t stride = 32 * kWidth;
  const int64_t strides = bytes / stride;
  const int64_t per_warp = (strides + warps - 1) / warps;
  T v;
  std::memset(&v, 0x5a, sizeof(v));
  if (lane >= lanes) return;
  for (int64_t s = warp * per_warp; s < min(strides, (warp + 1) * per_warp); ++s) {
    reinterpret_cast<T*>(dst + s * stride)[lane] = v;
  }
}

// GB/s of bytes actually stored, mean of 10 launches after a warm-up.
template <int kWidth>
float store_gbps(uint8_t* dst, int64_t bytes, int lanes, int ctas) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  store_kernel<kWidth><<<ctas, 256>>>(dst, bytes, lanes);
  cudaEventRecord(a);
  const int reps = 10;
  for (int r = 0; r < reps; ++r) store_kernel<kWidth><<<ctas, 256>>>(dst, bytes, lanes);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return static_cast<float>(static_cast<double>(bytes) * lanes / 32 / (ms / reps) / 1e6);
}

// One line per (lanes, CTAs) at this store width: peer and local GB/s.
template <int kWidth>
void sweep(uint8_t* peer, uint8_t* local, int64_t bytes, int sms) {
  for (int lanes : {32, 16, 8}) {
    for (int ctas : {sms / 4, sms, 2 * sms, 8 * sms}) {
      const float gp = peer != nullptr ? store_gbps<kWidth>(peer, bytes, lanes, ctas) : 0.f;
      const float gl = store_gbps<kWidth>(local, bytes, lanes, ctas);
      std::printf("%-6s %-6d %-6d %-6d %10.0f %10.0f\n", "peer", kWidth, lanes, ctas, gp, gl);
    }
  }
}

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  const int64_t bytes = int64_t{256} << 20;
  uint8_t *local = nullptr, *peer = nullptr, *src = nullptr;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (n >= 2) {
    CHECK(cudaSetDevice(1));
    CHECK(cudaMalloc(&peer, bytes));
  }
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&local, bytes));
  CHECK(cudaMalloc(&src, bytes));
  if (n >= 2) CHECK(cudaDeviceEnablePeerAccess(1, 0));
  std::printf("%d GPUs, %d SMs; 256 MiB per run, GB/s of bytes actually stored\n", n, sms);
  if (n >= 2) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    CHECK(cudaMemcpyPeerAsync(peer, 1, src, 0, bytes));
    cudaEventRecord(a);
    for (int r = 0; r < 10; ++r) CHECK(cudaMemcpyPeerAsync(peer, 1, src, 0, bytes));
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    std::printf("copy engine to peer: %.0f GB/s\n", bytes / (ms / 10) / 1e6);
  }
  std::printf("%-6s %-6s %-6s %-6s %10s %10s\n", "target", "width", "lanes", "ctas", "peer GB/s", "local GB/s");
  sweep<4>(peer, local, bytes, sms);
  sweep<8>(peer, local, bytes, sms);
  sweep<16>(peer, local, bytes, sms);
  CHECK(cudaGetLastError());
  return 0;
}
