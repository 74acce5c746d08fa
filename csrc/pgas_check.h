// The extension's checks, for host code of .cu and .cpp files alike.
#pragma once

#include <cstdio>

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
