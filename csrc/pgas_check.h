// The extension's checks, for host code of .cu and .cpp files alike. Only c10's
// exception header: a kernel file that includes it stays free of ATen's tensor
// headers (each costs nvcc about 10 s of a 2-core build).
#pragma once

#include <cstdio>

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

// TORCH_CHECK with a printf-style message formatted here, into a plain buffer
// handed to c10 as one C string. TORCH_CHECK's own multi-argument messages are
// built with a std::ostringstream inside this extension, which crashed the
// process (SIGSEGV) on a GPU machine's build instead of raising.
#define PGAS_CHECK(cond, ...)                                     \
  do {                                                            \
    if (!(cond)) {                                                \
      char pgas_msg__[512];                                       \
      std::snprintf(pgas_msg__, sizeof(pgas_msg__), __VA_ARGS__); \
      TORCH_CHECK(false, static_cast<const char*>(pgas_msg__));   \
    }                                                             \
  } while (0)

#define PGAS_CUDA_CHECK(expr)                                                                      \
  do {                                                                                             \
    cudaError_t err__ = (expr);                                                                    \
    PGAS_CHECK(err__ == cudaSuccess, "CUDA error: %s at %s:%d", cudaGetErrorString(err__), __FILE__, \
               __LINE__);                                                                          \
  } while (0)
