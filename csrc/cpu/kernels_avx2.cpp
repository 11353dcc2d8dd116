// avx2 kernels: bgmv_impl.h instantiated with the VecAvx2 policy.
#include "kernels_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace vllm_cpu_lora::avx2 {
// In this order: vector policy, kernel templates, AMX parts.
#include "vec_avx2.h"

#include "bgmv_impl.h"

IsaKernels Kernels() { return MakeKernels<VecAvx2>(); }
}  // namespace vllm_cpu_lora::avx2

#pragma GCC pop_options
