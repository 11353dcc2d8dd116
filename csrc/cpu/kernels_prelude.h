// Included first by every kernels_<isa>.cpp, before its `#pragma GCC target`:
// everything here is compiled for the baseline ISA, so inline functions it
// defines are identical in every TU (no one-definition-rule hazard).
#pragma once

#if defined(__clang__) || !defined(__GNUC__)
#error "kernels_<isa>.cpp use `#pragma GCC target`: build them with GCC"
#endif

#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "bgmv_params.h"
