// Portable kernels: bgmv_impl.h instantiated with the scalar policy, built
// with the baseline flags only.
#include "kernels_prelude.h"

namespace vllm_cpu_lora::scalar {
// In this order: vector policy, kernel templates, AMX parts.
#include "vec_scalar.h"

#include "bgmv_impl.h"

IsaKernels Kernels() { return MakeKernels<VecScalar>(); }
}  // namespace vllm_cpu_lora::scalar
