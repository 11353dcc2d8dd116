// neon_bf16 kernels: the kernel templates with VecNeon<true> (BFDOT), for
// FEAT_BF16 CPUs (Neoverse V1/V2/N2, Graviton3/4, Grace).
// Built on aarch64 only (setup.py and CMake compile every csrc/cpu/*.cpp).
#if defined(__aarch64__)
#include "kernels_prelude.h"

#pragma GCC push_options
// arm_neon.h declares the bf16 intrinsics for armv8.2-a+bf16, and GCC inlines
// them only into code with at least that ISA; FEAT_BF16 implies Armv8.2-A.
#pragma GCC target("arch=armv8.2-a+bf16")

#define VLLM_CPU_LORA_ISA_NS neon_bf16
#include "bgmv_impl.h"
#include "vec_neon.h"

namespace vllm_cpu_lora::neon_bf16 {
IsaKernels Kernels() { return MakeKernels<VecNeon<true>>(); }
}  // namespace vllm_cpu_lora::neon_bf16

#pragma GCC pop_options

#endif  // defined(__aarch64__)
