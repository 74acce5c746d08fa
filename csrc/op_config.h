// An op's config argument on the host: the bytes of a step_abi.h struct, held
// in a CPU uint8 tensor (torchrec_pgas.step_abi packs them).
#pragma once

#include <cstring>

#include <ATen/core/Tensor.h>

#include "pgas_check.h"

// The size checked; the error names the op and the struct (`an OwnerUpdateConfig`).
template <typename Config>
Config config_from_bytes(const at::Tensor& config, const char* op, const char* struct_name) {
  PGAS_CHECK(config.device().is_cpu() && config.scalar_type() == at::kByte &&
                 config.numel() == static_cast<int64_t>(sizeof(Config)),
             "%s: config must be the %zu bytes of %s (CPU uint8)", op, sizeof(Config), struct_name);
  Config c;
  std::memcpy(&c, config.contiguous().data_ptr(), sizeof(c));
  return c;
}
