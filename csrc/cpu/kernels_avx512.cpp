// avx512 kernels: bgmv_impl.h instantiated with the VecAvx512<false> policy.
#include "kernels_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

namespace vllm_cpu_lora::avx512 {
// In this order: vector policy, kernel templates, AMX parts.
#include "vec_avx512.h"

#include "bgmv_impl.h"

IsaKernels Kernels() { return MakeKernels<VecAvx512<false>>(); }
}  // namespace vllm_cpu_lora::avx512

#pragma GCC pop_options
