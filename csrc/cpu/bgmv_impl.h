// Kernel templates for the LoRA products
//   out[t, n] = scale * sum_k x[t, k] * w[a, n, k]  (+ out[t, n])
// parameterised by a vector policy V (one per ISA: vec_avx512.h, vec_avx2.h,
// vec_scalar.h) and the element types of x, w and out.
//
// The two blockings are kernel_dot.h and kernel_pack.h (with kernel_rows.h);
// each kernels_<isa>.cpp instantiates them in its own namespace
// (kernel_isa_namespace.h).
//
// Arithmetic: products of the operands as given, fp32 accumulation, one
// rounding to the output type. One exception, as in vLLM's torch ops (which
// cast inputs to the output dtype): with bf16 weights and bf16 output, fp32
// inputs are rounded to bf16 so AVX512-BF16 / AMX pair products can be used.
#pragma once

#include <cstdint>

#include "kernel_common.h"
#include "kernel_dot.h"
#include "kernel_interface.h"
#include "kernel_isa_namespace.h"
#include "kernel_pack.h"
#include "tuning.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

template <class V>
void RunDot(const LoraArgs& a, const WorkItem* items, int64_t begin,
            int64_t end) {
  WithTypes(a, [&](auto tx, auto tw, auto to) {
    DotKernel<V, decltype(tx), decltype(tw), decltype(to)>::Run(a, items, begin,
                                                                end);
  });
}

template <class V>
void RunPack(const LoraArgs& a, const WorkItem* items, int64_t begin,
             int64_t end) {
  WithTypes(a, [&](auto tx, auto tw, auto to) {
    PackKernel<V, decltype(tx), decltype(tw), decltype(to)>::Run(a, items,
                                                                 begin, end);
  });
}

template <class V>
IsaKernels MakeKernels() {
  return IsaKernels{&RunDot<V>, &RunPack<V>, V::kBf16Dot,
                    SplitTokensPerThread(V::kBf16Dot)};
}

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
