// The extension's checks, for host code of .cu and .cpp files alike.
#pragma once

#include <cstdio>
#include <cstring>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

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

// The config struct an op's `config` argument holds (its bytes, a CPU uint8 tensor): the size checked, the
// error naming the op and the struct (`an OwnerUpdateConfig`).
template <typename Config>
Config config_from_bytes(const at::Tensor& config, const char* op, const char* struct_name) {
  PGAS_CHECK(config.device().is_cpu() && config.scalar_type() == at::kByte &&
                 config.numel() == static_cast<int64_t>(sizeof(Config)),
             "%s: config must be the %zu bytes of %s (CPU uint8)", op, sizeof(Config), struct_name);
  Config c;
  std::memcpy(&c, config.contiguous().data_ptr(), sizeof(c));
  return c;
}
