// The AMX kernel of bgmv_amx.h on software-emulated tiles (amx_emulation.h),
// so its blocking, packing and remainder logic is tested on CPUs without AMX.
// Needs AVX512-BF16 for everything around the tiles.
// Built on x86-64 only (setup.py and CMake compile every csrc/cpu/*.cpp).
#if defined(__x86_64__)
#include "kernels_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")

#define VLLM_CPU_LORA_ISA_NS amx_emulated
#include "amx_emulation.h"
#include "bgmv_amx.h"

namespace vllm_cpu_lora::amx_emulated {
IsaKernels Kernels() { return MakeAmxKernels(); }
}  // namespace vllm_cpu_lora::amx_emulated

#pragma GCC pop_options

#endif  // defined(__x86_64__)
