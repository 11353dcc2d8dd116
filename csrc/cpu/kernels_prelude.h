// Included first by every kernels_<isa>.cpp, before its `#pragma GCC target`:
// every header outside this project that the kernel headers include must be
// first included here, compiled for the baseline ISA, so that the inline
// functions it defines are identical in every TU (no one-definition-rule
// hazard). A new include in a kernel header belongs here too.
#pragma once

#if defined(__clang__) || !defined(__GNUC__)
#error "kernels_<isa>.cpp use `#pragma GCC target`: build them with GCC"
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "amx_tile_config.h"
#include "kernel_interface.h"
#include "tuning.h"
