// avx512 kernels (no BF16): the kernel templates with VecAvx512<false>.
// Built on x86-64 only (setup.py and CMake compile every csrc/cpu/*.cpp).
#if defined(__x86_64__)
#include "kernels_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

#define VLLM_CPU_LORA_ISA_NS avx512
#include "bgmv_impl.h"
#include "vec_avx512.h"

namespace vllm_cpu_lora::avx512 {
IsaKernels Kernels() { return MakeKernels<VecAvx512<false>>(); }
}  // namespace vllm_cpu_lora::avx512

#pragma GCC pop_options

#endif  // defined(__x86_64__)
