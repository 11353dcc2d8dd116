// Portable "vector" policy for the kernel templates (bgmv_impl.h): one fp32
// lane, plain C++, c10's conversions. Runs on any CPU; the compiler may still
// auto-vectorise.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "kernel_isa_namespace.h"
#include "tuning.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

struct VecScalar {
  static constexpr int kLanes = 1;
  static constexpr bool kBf16Dot = false;
  static constexpr int kTileM = 2;
  static constexpr int kTileN = 2;
  static constexpr int kPackTileM = 2;
  static constexpr int kPackVectors = 4;
  static constexpr bool kGather = false;
  static constexpr bool kRowGroups = false;
  static constexpr bool kSplitBf16 = false;
  using F = float;

  // The rows-vs-pack rule of this ISA (tuning.h): measured on AVX-512 only.
  static constexpr int64_t RowsMaxTokens(int64_t k, bool grouped,
                                         WeightProducts /*p*/) {
    return ::vllm_cpu_lora::RowsMaxTokens(k, grouped);
  }

  static F Zero() { return 0.0f; }
  static F Set1(float v) { return v; }
  static F Fma(F a, F b, F c) { return a * b + c; }
  static F Add(F a, F b) { return a + b; }
  static F Mul(F a, F b) { return a * b; }
  static float Reduce(F v) { return v; }
  static F SumLanes(const F (&acc)[kLanes]) { return acc[0]; }

  template <class T>
  static F Load(const T* p) {
    return static_cast<float>(*p);
  }
  // kLanes == 1: a partial load or store has n == 0.
  template <class T>
  static F LoadPartial(const T*, int) {
    return 0.0f;
  }
  template <class T>
  static void Store(T* p, F v) {
    *p = static_cast<T>(v);
  }
  template <class T>
  static void StorePartial(T*, F, int) {}
};

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
