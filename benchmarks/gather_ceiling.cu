// What one GPU's HBM delivers to a random-row gather, next to streaming reads and
// a copy (benchmarks/archive/NOTES-2026-11.md.gz §20): the ceiling the PGAS lookup is measured against.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/gather_ceiling.cu -o /tmp/gather_ceiling && /tmp/gather_ceiling
//
// The gather kernel is the lookup's inner loop without its bookkeeping: groups of
// G = row_bytes / 16 lanes, each lane one 16-byte vector of the row, every group
// keeps K row loads in flight before it adds them, and rows are uniform over a
// table of `table_bytes`. Row ids come from a hash of (group, step) ("hash": no
// id loads, the best case) or from an int32 array read G at a time and broadcast
// by shuffles, as the lookup reads a bag's ids ("ids"), or so with K loads always
// in flight ("roll"; "hroll": hashed ids). One float per thread is
// written at the end, so the bytes moved are the rows read. Bandwidth = rows read
// x row_bytes / time (mean of 5 launches after a warm-up).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#define CHECK(x)                                                                            \
  do {                                                                                      \
    cudaError_t e = (x);                                                                    \
    if (e != cudaSuccess) {                                                                 \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__);   \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Each group gathers `steps` x K rows. kIds: row ids from `ids` (group-major,
// `steps * K` per group), else from the hash. kRoll: row j + K's load issues as
// soon as row j is added (K loads always in flight), else K loads issue in a
// round and are all added before the next round (the lookup's scheme). `rows` < 2^32.
template <int K, bool kIds, bool kRoll>
__global__ void __launch_bounds__(kThreads) gather_kernel(const uint8_t* table, uint32_t rows, int row_bytes,
                                                         const int32_t* ids, int steps, float* sink) {
  const int G = row_bytes / 16;
  const int lane = threadIdx.x % 32;
  const int g_lane = lane % G;
  const unsigned gmask = G == 32 ? 0xffffffffu : (((1u << G) - 1) << (lane / G * G));
  const uint64_t group = (static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x) / G;
  const int32_t* my_ids = kIds ? ids + group * steps * K : nullptr;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  // Ids G at a time, one per lane, the next chunk loading while this one is used
  // (the lookup's prefetch; the array has a chunk of slack past its end).
  int32_t id_chunk = 0, id_next = kIds ? __ldcg(my_ids + g_lane) : 0;
  const auto row_of = [&](int j) -> uint32_t {
    if (kIds) {
      if (j % G == 0) {
        id_chunk = id_next;
        id_next = __ldcg(my_ids + j + G + g_lane);
      }
      return static_cast<uint32_t>(__shfl_sync(gmask, id_chunk, j % G, G));
    }
    return static_cast<uint32_t>((static_cast<uint64_t>(hash32(group * 0x9e3779b97f4a7c15ULL + j)) * rows) >> 32);
  };
  const auto load = [&](uint32_t r) {
    return __ldg(reinterpret_cast<const float4*>(table + static_cast<uint64_t>(r) * row_bytes) + g_lane);
  };
  const auto add = [&](const float4& v) {
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  };
  float4 v[K];
  if (kRoll) {
#pragma unroll
    for (int u = 0; u < K; ++u) v[u] = load(row_of(u));
  }
  for (int s = 0; s < steps; ++s) {
    if (kRoll) {
      const bool more = s + 1 < steps;
#pragma unroll
      for (int u = 0; u < K; ++u) {
        add(v[u]);
        v[u] = load(more ? row_of((s + 1) * K + u) : 0u);
      }
    } else {
#pragma unroll
      for (int u = 0; u < K; ++u) v[u] = load(row_of(s * K + u));
#pragma unroll
      for (int u = 0; u < K; ++u) add(v[u]);
    }
  }
  sink[blockIdx.x * kThreads + threadIdx.x] = acc.x + acc.y + acc.z + acc.w;
}

// Streaming read of `bytes` (float4 grid stride), for the read-only bandwidth.
__global__ void __launch_bounds__(kThreads) read_kernel(const float4* src, uint64_t n, float* sink) {
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * kThreads) {
    const float4 v = __ldcs(src + i);
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  sink[blockIdx.x * kThreads + threadIdx.x] = acc.x + acc.y + acc.z + acc.w;
}

template <typename F>
double time_ms(F launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < 5; ++i) launch();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaGetLastError());
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms / 5.0;
}

__global__ void fill_ids(int32_t* ids, uint64_t n, uint32_t rows) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    ids[i] = static_cast<int32_t>((static_cast<uint64_t>(hash32(i * 0x2545f4914f6cdd1dULL + 7)) * rows) >> 32);
  }
}

struct Ctx {
  int sms;
  uint8_t* table;
  uint64_t table_cap;
  int32_t* ids;
  float* sink;
};

// GB/s of a random-row gather over the first `table_bytes` of the table, with
// `per_sm` CTAs per SM (0: as many as fit; set to the number used).
template <int K, bool kIds, bool kRoll>
double gather_gbps(const Ctx& c, uint64_t table_bytes, int row_bytes, int& per_sm, uint64_t read_bytes) {
  int max_per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&max_per_sm, gather_kernel<K, kIds, kRoll>, kThreads, 0));
  per_sm = per_sm > 0 ? std::min(per_sm, max_per_sm) : max_per_sm;
  const int ctas = c.sms * per_sm;
  const uint64_t groups = static_cast<uint64_t>(ctas) * kThreads / (row_bytes / 16);
  const int steps = static_cast<int>(std::max<uint64_t>(1, read_bytes / row_bytes / groups / K));
  const uint32_t rows = static_cast<uint32_t>(table_bytes / row_bytes);
  if (kIds) fill_ids<<<c.sms * 8, 256>>>(c.ids, groups * steps * K, rows);
  const double ms = time_ms([&] {
    gather_kernel<K, kIds, kRoll><<<ctas, kThreads>>>(c.table, rows, row_bytes, c.ids, steps, c.sink);
  });
  return static_cast<double>(groups) * steps * K * row_bytes / (ms * 1e6);
}

template <int K>
double gather_mode(const Ctx& c, std::string_view mode, uint64_t table_bytes, int row_bytes, int& per_sm) {
  const uint64_t read_bytes = uint64_t{8} << 30;
  return mode == "ids"     ? gather_gbps<K, true, false>(c, table_bytes, row_bytes, per_sm, read_bytes)
         : mode == "roll"  ? gather_gbps<K, true, true>(c, table_bytes, row_bytes, per_sm, read_bytes)
         : mode == "hroll" ? gather_gbps<K, false, true>(c, table_bytes, row_bytes, per_sm, read_bytes)
                           : gather_gbps<K, false, false>(c, table_bytes, row_bytes, per_sm, read_bytes);
}

// One configuration of the sweep: ids ("hash", "ids", "roll", "hroll"), table
// and row size, K rows in flight per group, CTAs per SM (0: as many as fit).
struct Config {
  const char* mode;
  uint64_t table_bytes;
  int row_bytes, k, per_sm;
};

void gather_row(const Ctx& c, const Config& cfg) {
  int per_sm = cfg.per_sm;
  const double gbps = cfg.k == 4    ? gather_mode<4>(c, cfg.mode, cfg.table_bytes, cfg.row_bytes, per_sm)
                      : cfg.k == 8  ? gather_mode<8>(c, cfg.mode, cfg.table_bytes, cfg.row_bytes, per_sm)
                      : cfg.k == 16 ? gather_mode<16>(c, cfg.mode, cfg.table_bytes, cfg.row_bytes, per_sm)
                                    : gather_mode<32>(c, cfg.mode, cfg.table_bytes, cfg.row_bytes, per_sm);
  std::printf("gather  %-5s table %6.2f GiB  row %3d B  K %2d  ctas/SM %d  %7.0f GB/s\n", cfg.mode,
              cfg.table_bytes / double(uint64_t{1} << 30), cfg.row_bytes, cfg.k, per_sm, gbps);
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  size_t free_b = 0, total_b = 0;
  CHECK(cudaMemGetInfo(&free_b, &total_b));
  Ctx c;
  c.sms = prop.multiProcessorCount;
  c.table_cap = uint64_t{16} << 30;  // s000-weak: 64 tables x 1M rows x 256 B per owner
  const uint64_t id_cap = uint64_t{8} << 30 >> 7 << 2;  // 8 GiB of 128-byte rows: 64M ids
  CHECK(cudaMalloc(&c.table, c.table_cap));
  CHECK(cudaMalloc(&c.ids, id_cap));
  CHECK(cudaMalloc(&c.sink, static_cast<size_t>(c.sms) * 32 * kThreads * sizeof(float)));
  CHECK(cudaMemset(c.table, 0x3c, c.table_cap));
  std::printf("device %s, %d SMs, L2 %d MiB, %.0f GiB free\n", prop.name, c.sms, prop.l2CacheSize >> 20,
              free_b / double(uint64_t{1} << 30));

  // Streaming references: read-only, and a copy counted as read + write bytes
  // (the benchmark's HBM bandwidth, benchmarks/embedding.py).
  const uint64_t half = c.table_cap / 2;
  const double read_ms = time_ms([&] {
    read_kernel<<<c.sms * 8, kThreads>>>(reinterpret_cast<const float4*>(c.table), c.table_cap / 16, c.sink);
  });
  std::printf("stream read  %.2f GiB  %7.0f GB/s\n", c.table_cap / double(uint64_t{1} << 30),
              c.table_cap / (read_ms * 1e6));
  const double copy_ms = time_ms([&] {
    CHECK(cudaMemcpyAsync(c.table + half, c.table, half, cudaMemcpyDeviceToDevice));
  });
  std::printf("copy (r+w)   %.2f GiB  %7.0f GB/s\n", half / double(uint64_t{1} << 30),
              2.0 * half / (copy_ms * 1e6));

  constexpr uint64_t GiB = uint64_t{1} << 30, MiB = uint64_t{1} << 20;
  const uint64_t big = c.table_cap;
  const Config sweep[] = {
      // The lookup's shape (256-byte rows, K = 8, as many CTAs as fit) over table sizes:
      // from L2-resident to the s000-weak owner's 16 GiB.
      {"hash", 32 * MiB, 256, 8, 0}, {"hash", 256 * MiB, 256, 8, 0}, {"hash", 2 * GiB, 256, 8, 0},
      {"hash", big, 256, 8, 0},
      // At 16 GiB: rows in flight, row width, occupancy, and ids read from memory.
      {"hash", big, 256, 4, 0}, {"hash", big, 256, 16, 0}, {"hash", big, 256, 32, 0},
      {"hash", big, 128, 8, 0}, {"hash", big, 128, 16, 0}, {"hash", big, 512, 8, 0},
      {"hash", big, 256, 8, 1}, {"hash", big, 256, 8, 2}, {"hash", big, 256, 8, 4},
      {"ids", big, 256, 8, 0}, {"ids", big, 256, 16, 0}, {"ids", big, 256, 8, 2},
      // Rolling (ids from memory, or hashed): K loads in flight at every add.
      {"hash", big, 256, 8, 2}, {"hroll", big, 256, 8, 2}, {"roll", big, 256, 8, 2},
      {"roll", big, 256, 8, 4}, {"roll", big, 256, 4, 4},
  };
  for (const Config& cfg : sweep) gather_row(c, cfg);
  return 0;
}
