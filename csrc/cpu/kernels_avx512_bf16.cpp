// avx512_bf16 kernels: bgmv_impl.h instantiated with the VecAvx512<true>
// policy.
#include "kernels_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")

namespace vllm_cpu_lora::avx512_bf16 {
// In this order: vector policy, kernel templates, AMX parts.
#include "vec_avx512.h"

#include "bgmv_impl.h"

IsaKernels Kernels() { return MakeKernels<VecAvx512<true>>(); }
}  // namespace vllm_cpu_lora::avx512_bf16

#pragma GCC pop_options
