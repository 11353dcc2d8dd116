// AMX kernels (Sapphire Rapids and later): bgmv_amx.h on real tiles, with the
// AVX512-BF16 kernels for small groups and other type combinations.
// Built on x86-64 only (setup.py and CMake compile every csrc/cpu/*.cpp).
#if defined(__x86_64__)
#include "kernels_prelude.h"

#pragma GCC push_options
#pragma GCC target( \
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")

#define VLLM_CPU_LORA_ISA_NS amx
#include "bgmv_amx.h"

namespace vllm_cpu_lora::amx {
IsaKernels Kernels() { return MakeAmxKernels(); }
}  // namespace vllm_cpu_lora::amx

#pragma GCC pop_options

#endif  // defined(__x86_64__)
