// NEON (Advanced SIMD) vector policy for the kernel templates (bgmv_impl.h):
// 4 fp32 lanes, FMA, bf16 and fp16 widened on load; with kBf16, FEAT_BF16's
// BFDOT pair dot products for bf16 weights. Tails go through a small
// zero-padded stack buffer, so no byte past the n-th element is read or
// written. Include only from kernels_neon*.cpp.
//
// BFDOT rounds each pair sum and each accumulation to odd, up to one fp32
// ulp each (tests/oracle.py bounds that), and flushes subnormals; FEAT_EBF16's
// FPCR.EBF would change both, but only some BF16 CPUs have it.
#pragma once

#include <arm_neon.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel_isa_namespace.h"
#include "tuning.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

template <bool kBf16>
struct VecNeon {
  static constexpr int kLanes = 4;
  static constexpr bool kBf16Dot = kBf16;
  // 32 vector registers, as AVX-512: the same 4 x 4 accumulator tiles (dot
  // and pack).
  static constexpr int kTileM = 4;
  static constexpr int kTileN = 4;
  static constexpr int kPackTileM = 4;
  static constexpr int kPackVectors = 4;
  static constexpr bool kGather = true;
  static constexpr bool kRowGroups = false;  // A 4-lane vector holds one row.
  static constexpr bool kSplitBf16 = false;
  using F = float32x4_t;

  // Not measured on Arm: AVX2's rule, the x86 path nearest in width.
  static constexpr int64_t RowsMaxTokens(int64_t k, bool grouped,
                                         WeightProducts p) {
    return RowsMaxTokensAvx2(k, grouped, p);
  }

  static F Zero() { return vdupq_n_f32(0.0f); }
  static F Set1(float v) { return vdupq_n_f32(v); }
  static F Fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F Add(F a, F b) { return vaddq_f32(a, b); }
  static F Mul(F a, F b) { return vmulq_f32(a, b); }
  static float Reduce(F v) { return vaddvq_f32(v); }

  // Lane j of the result = the sum of the lanes of acc[j].
  static F SumLanes(const F (&acc)[kLanes]) {
    return vpaddq_f32(vpaddq_f32(acc[0], acc[1]), vpaddq_f32(acc[2], acc[3]));
  }

  static F Widen(uint16x4_t h, c10::BFloat16) {
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
  }
  static F Widen(uint16x4_t h, c10::Half) {
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
  }

  template <class T>
  static F Load(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return vld1q_f32(p);
    } else {
      return Widen(vld1_u16(reinterpret_cast<const uint16_t*>(p)), T{});
    }
  }

  template <class T>
  static F LoadPartial(const T* p, int n) {
    T buf[kLanes] = {};
    std::memcpy(buf, p, n * sizeof(T));
    return Load(buf);
  }

  // Same rounding as c10::BFloat16(float): nearest even, NaN kept quiet.
  static uint16x4_t Narrow(F v, c10::BFloat16) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t r = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff)));
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(v, v));
    return vshrn_n_u32(vbslq_u32(nan, vdupq_n_u32(0x7fc00000), r), 16);
  }
  static uint16x4_t Narrow(F v, c10::Half) {
    return vreinterpret_u16_f16(vcvt_f16_f32(v));
  }

  template <class T>
  static void Store(T* p, F v) {
    if constexpr (std::is_same_v<T, float>) {
      vst1q_f32(p, v);
    } else {
      vst1_u16(reinterpret_cast<uint16_t*>(p), Narrow(v, T{}));
    }
  }

  template <class T>
  static void StorePartial(T* p, F v, int n) {
    T buf[kLanes];
    Store(buf, v);
    std::memcpy(p, buf, n * sizeof(T));
  }

  // Transposes the 4 x 4 matrix of 32-bit lanes whose rows are r[0..4).
  static void Transpose(F (&r)[kLanes]) {
    auto pairs = [](F a, F b, bool high) {
      const float64x2_t x = vreinterpretq_f64_f32(a);
      const float64x2_t y = vreinterpretq_f64_f32(b);
      return vreinterpretq_f32_f64(high ? vtrn2q_f64(x, y) : vtrn1q_f64(x, y));
    };
    const F t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    const F t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    r[0] = pairs(t0, t2, false);
    r[1] = pairs(t1, t3, false);
    r[2] = pairs(t0, t2, true);
    r[3] = pairs(t1, t3, true);
  }

  static void StoreBits(float* p, F v) { vst1q_f32(p, v); }
  static void StoreBits(uint32_t* p, F v) {
    vst1q_u32(p, vreinterpretq_u32_f32(v));
  }

  // ---- weight packing for the pack blocking ----
  // Packs columns c < nt of P (see PackKernel::Pack): row j holds, for each
  // weight row c < nc, element j (fp32) or the bf16 pair (2j, 2j+1) (kPairs),
  // zero for nc <= c < nc rounded up to kLanes (later columns are not read).
  // Returns that rounded-up nc. Blocks of 4 weight rows x 4 dwords (4
  // elements widened to fp32, or 4 bf16 pairs as they are) are transposed
  // in registers.
  template <class TW, bool kPairs, class PackT>
  static int PackColumns(const TW* w, int64_t row_stride, int64_t k, int nc,
                         int nt, PackT* P) {
    constexpr int kPerDword = kPairs ? 2 : 1;
    const int64_t dwords = (k + kPerDword - 1) / kPerDword;
    for (int c0 = 0; c0 < nc; c0 += kLanes) {
      for (int64_t d0 = 0; d0 < dwords; d0 += kLanes) {
        const int64_t e0 = d0 * kPerDword;  // First element of the block.
        const int count =
            static_cast<int>(std::min<int64_t>(kLanes * kPerDword, k - e0));
        F r[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          const TW* row = w + (c0 + i) * row_stride + e0;
          if (c0 + i >= nc) {
            r[i] = Zero();
          } else if constexpr (kPairs) {
            r[i] = vreinterpretq_f32_bf16(LoadPairsPartial(row, count));
          } else {
            r[i] = count == kLanes ? Load(row) : LoadPartial(row, count);
          }
        }
        Transpose(r);
        const int64_t valid = std::min<int64_t>(kLanes, dwords - d0);
        for (int q = 0; q < valid; ++q) StoreBits(P + (d0 + q) * nt + c0, r[q]);
      }
    }
    return (nc + kLanes - 1) / kLanes * kLanes;
  }

  // ---- bf16 pair dot products (kBf16Dot only) ----
  using BH = bfloat16x8_t;
  static constexpr int kPairLanes = 2 * kLanes;  // bf16 elements per BH.

  // 8 elements of T as bf16 (fp32 is rounded to nearest even).
  template <class T>
  static BH LoadPairs(const T* p) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return vreinterpretq_bf16_u16(
          vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
    } else {
      static_assert(std::is_same_v<T, float>);
      return vreinterpretq_bf16_u16(
          vcombine_u16(Narrow(vld1q_f32(p), c10::BFloat16{}),
                       Narrow(vld1q_f32(p + kLanes), c10::BFloat16{})));
    }
  }

  template <class T>
  static BH LoadPairsPartial(const T* p, int n) {
    T buf[kPairLanes] = {};
    std::memcpy(buf, p, n * sizeof(T));
    return LoadPairs(buf);
  }

  static BH LoadPacked(const uint32_t* p) {
    return vreinterpretq_bf16_u32(vld1q_u32(p));
  }
  static BH LoadPackedPartial(const uint32_t* p, int n) {
    uint32_t buf[kLanes] = {};
    std::memcpy(buf, p, n * sizeof(uint32_t));
    return LoadPacked(buf);
  }
  static BH BroadcastPair(uint32_t pair) {
    return vreinterpretq_bf16_u32(vdupq_n_u32(pair));
  }
  static F Dot(F acc, BH a, BH b) { return vbfdotq_f32(acc, a, b); }
};

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
