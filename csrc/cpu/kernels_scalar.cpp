// Portable kernels: the kernel templates with the scalar policy, built with the
// baseline flags only.
#include "kernels_prelude.h"

#define VLLM_CPU_LORA_ISA_NS scalar
#include "bgmv_impl.h"
#include "vec_scalar.h"

namespace vllm_cpu_lora::scalar {
IsaKernels Kernels() { return MakeKernels<VecScalar>(); }
}  // namespace vllm_cpu_lora::scalar
