// neon kernels: the kernel templates with VecNeon<false>. Advanced SIMD is
// part of every aarch64 CPU, so the baseline flags suffice.
// Built on aarch64 only (setup.py and CMake compile every csrc/cpu/*.cpp).
#if defined(__aarch64__)
#include "kernels_prelude.h"

#define VLLM_CPU_LORA_ISA_NS neon
#include "bgmv_impl.h"
#include "vec_neon.h"

namespace vllm_cpu_lora::neon {
IsaKernels Kernels() { return MakeKernels<VecNeon<false>>(); }
}  // namespace vllm_cpu_lora::neon

#endif  // defined(__aarch64__)
