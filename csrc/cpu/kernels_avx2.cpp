// avx2 kernels: the kernel templates with the VecAvx2 policy.
// Built on x86-64 only (setup.py and CMake compile every csrc/cpu/*.cpp).
#if defined(__x86_64__)
#include "kernels_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#define VLLM_CPU_LORA_ISA_NS avx2
#include "bgmv_impl.h"
#include "vec_avx2.h"

namespace vllm_cpu_lora::avx2 {
IsaKernels Kernels() { return MakeKernels<VecAvx2>(); }
}  // namespace vllm_cpu_lora::avx2

#pragma GCC pop_options

#endif  // defined(__x86_64__)
