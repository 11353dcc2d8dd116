// AVX2 + FMA + F16C vector policy for the kernel templates (bgmv_impl.h): 8
// fp32 lanes. Tails of 16-bit types are read by masked loads (LoadShorts)
// and written through a small stack buffer, so no byte past the n-th element
// is read or written. Include only from kernels_avx2.cpp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel_isa_namespace.h"
#include "tuning.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

struct VecAvx2 {
  static constexpr int kLanes = 8;
  static constexpr bool kBf16Dot = false;
  // Dot tiles of 3 tokens x 4 weight rows: 12 accumulators, 3 inputs and
  // a weight vector fill the 16 registers; split bf16 operands take two
  // registers each, so theirs are 2 x 4 (#dot-tiles).
  static constexpr int kTileM = 3;
  static constexpr int kTileN = 4;
  static constexpr int kSplitTileM = 2;
  static constexpr int kSplitTileN = 4;
  // Pack tiles of 4 tokens x 3 vectors: 12 accumulators, 3 weight vectors
  // and a broadcast fill the 16 registers, and 12 independent FMA chains
  // hide the FMA latency, which 2 x 4 (8 chains) did not (#pack-tiles).
  static constexpr int kPackTileM = 4;
  static constexpr int kPackVectors = 3;
  static constexpr bool kGather = true;
  // Rows of 8 bf16 (or 4 fp32, fp16) elements two to a vector
  // (#rows-groups-avx2).
  static constexpr bool kRowGroups = true;
  // bf16 weights split 16 at a time (LoadSplit): see there.
  static constexpr bool kSplitBf16 = true;
  using F = __m256;

  static __m256i Mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }

  // The rows-vs-pack rule of this ISA (tuning.h).
  static constexpr int64_t RowsMaxTokens(int64_t k, bool grouped,
                                         WeightProducts p) {
    return RowsMaxTokensAvx2(k, grouped, p);
  }

  static F Zero() { return _mm256_setzero_ps(); }
  static F Set1(float v) { return _mm256_set1_ps(v); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static float Reduce(F v) {
    __m128 s =
        _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // Lane j of the result = the sum of the lanes of acc[j] (transpose-add).
  // Always inlined: GCC otherwise calls it, spilling acc to the stack.
  [[gnu::always_inline]] static F SumLanes(const F (&acc)[kLanes]) {
    F c[4], d[2];
    for (int i = 0; i < 4; ++i) {
      c[i] = _mm256_add_ps(_mm256_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                           _mm256_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    }
    for (int i = 0; i < 2; ++i) {
      const __m256d lo = _mm256_castps_pd(c[2 * i]);
      const __m256d hi = _mm256_castps_pd(c[2 * i + 1]);
      d[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(lo, hi)),
                           _mm256_castpd_ps(_mm256_unpackhi_pd(lo, hi)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(d[0], d[1], 0x20),
                         _mm256_permute2f128_ps(d[0], d[1], 0x31));
  }

  // Lane i of the result = the sum of lane group i % 2 of acc[i / 2],
  // groups being G = 4 adjacent lanes: the first stages of SumLanes' tree,
  // then one permutation into row order.
  template <int G>
  static F SumGroups(const F (&acc)[G]) {
    static_assert(G == 4, "a group of 8 lanes is a whole vector: SumLanes");
    F c[2];
    for (int i = 0; i < 2; ++i) {
      c[i] = _mm256_add_ps(_mm256_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                           _mm256_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    }
    const __m256d lo = _mm256_castps_pd(c[0]);
    const __m256d hi = _mm256_castps_pd(c[1]);
    // Lane l holds row 2l (l < 4) or 2(l - 4) + 1.
    const F d = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(lo, hi)),
                              _mm256_castpd_ps(_mm256_unpackhi_pd(lo, hi)));
    return _mm256_permutevar8x32_ps(d,
                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }

  // p[0..G) repeated over the 8 lanes, G = 4.
  template <int G>
  static F Repeat(const float* p) {
    static_assert(G == 4);
    return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
  }

  static F Widen(__m128i h, c10::BFloat16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F Widen(__m128i h, c10::Half) { return _mm256_cvtph_ps(h); }

  template <class T>
  static F Load(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm256_loadu_ps(p);
    } else {
      return Widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), T{});
    }
  }

  template <class T>
  static F LoadPartial(const T* p, int n) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm256_maskload_ps(p, Mask(n));
    } else {
      return Widen(_mm256_castsi256_si128(LoadShorts(p, n)), T{});
    }
  }

  // The first n < 16 16-bit elements at p, the others zero: the whole
  // dwords by a masked load (no byte past them is read), an odd last
  // element blended in; a copy through a stack buffer stalled store
  // forwarding (#short-rows).
  static __m256i LoadShorts(const void* p, int n) {
    __m256i v = _mm256_maskload_epi32(static_cast<const int*>(p), Mask(n / 2));
    if (n % 2 != 0) {
      int16_t last;
      std::memcpy(&last, static_cast<const int16_t*>(p) + n - 1, sizeof(last));
      const __m256i at =
          _mm256_cmpeq_epi16(_mm256_set1_epi16(static_cast<int16_t>(n - 1)),
                             _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                               11, 12, 13, 14, 15));
      v = _mm256_blendv_epi8(v, _mm256_set1_epi16(last), at);
    }
    return v;
  }

  // 16 elements as two fp32 vectors: the even-indexed ones and the
  // odd-indexed ones. For bf16 that is a shift and a mask of one 256-bit
  // load, half the work of widening 8 at a time, and products of such halves
  // summed over both are the dot product of the 16 (#avx2-split-bf16).
  struct Split {
    F even, odd;
  };
  template <class T>
  static Split LoadSplit(const T* p) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return SplitBf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
      const F a = Load(p), b = Load(p + kLanes);
      return {InOrder(_mm256_shuffle_ps(a, b, 0x88)),
              InOrder(_mm256_shuffle_ps(a, b, 0xdd))};
    }
  }
  // LoadSplit of the first n < 16 elements.
  static Split LoadSplitPartial(const c10::BFloat16* p, int n) {
    return SplitBf16(LoadShorts(p, n));
  }
  // The even and odd halves of 16 bf16.
  static Split SplitBf16(__m256i v) {
    return {
        _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
        _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(~0xffff)))};
  }
  // shuffle_ps picks within 128-bit halves: this puts its four 64-bit
  // pieces back in element order.
  static F InOrder(F v) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xd8));
  }
  // acc + the products of the halves of a and b.
  static F FmaSplit(const Split& a, const Split& b, F acc) {
    return Fma(a.odd, b.odd, Fma(a.even, b.even, acc));
  }

  // Same rounding as c10::BFloat16(float): nearest even, NaN kept quiet.
  static __m128i Narrow(F v, c10::BFloat16) {
    const __m256i r = _mm256_srli_epi32(RoundToBf16High(v), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r),
                            _mm256_extracti128_si256(r, 1));
  }
  // The rounding: each lane's bf16 in its upper half.
  static __m256i RoundToBf16High(F v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb =
        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r =
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
  }
  static __m128i Narrow(F v, c10::Half) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }

  template <class T>
  static void Store(T* p, F v) {
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(p, v);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Narrow(v, T{}));
    }
  }

  // Stores 16 bf16 at p, element 2i from v.even[i] and 2i + 1 from v.odd[i],
  // rounded as Store rounds: the inverse of LoadSplit, with no packing
  // across lanes (#rank-one-split).
  static void StoreSplit(c10::BFloat16* p, const Split& v) {
    const __m256i r = _mm256_blend_epi16(
        RoundToBf16High(v.odd), _mm256_srli_epi32(RoundToBf16High(v.even), 16),
        0x55);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), r);
  }

  // Transposes the 8 x 8 matrix whose rows are r[0..8).
  static void Transpose(F (&r)[kLanes]) {
    F t[8], s[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      for (int h = 0; h < 2; ++h) {
        const F a = t[4 * i + h], b = t[4 * i + h + 2];
        s[4 * i + 2 * h] = _mm256_shuffle_ps(a, b, 0x44);
        s[4 * i + 2 * h + 1] = _mm256_shuffle_ps(a, b, 0xee);
      }
    }
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
      r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
  }

  // ---- weight packing for the pack blocking ----
  // Packs columns c < nt of P (see PackKernel::Pack): row j holds element j
  // (as fp32) of each weight row c < nc, zero for nc <= c < nc rounded up to
  // kLanes (later columns are not read). Returns that rounded-up nc. Blocks
  // of 8 weight rows x 8 elements are loaded (widened) and transposed in
  // registers: a scalar copy costs several times more than the products of
  // a few tokens.
  template <class TW, bool kPairs>
  static int PackColumns(const TW* w, int64_t row_stride, int64_t k, int nc,
                         int nt, float* P) {
    static_assert(!kPairs, "AVX2 has no bf16 pair products");
    // 16-bit rows shorter than a vector: the caller's scalar copy beats
    // loading each in parts through a buffer (#short-rows).
    if (sizeof(TW) == 2 && k < kLanes) return 0;
    for (int c0 = 0; c0 < nc; c0 += kLanes) {
      for (int64_t j0 = 0; j0 < k; j0 += kLanes) {
        const int count = static_cast<int>(std::min<int64_t>(kLanes, k - j0));
        F r[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          const TW* row = w + (c0 + i) * row_stride + j0;
          r[i] = c0 + i >= nc      ? Zero()
                 : count == kLanes ? Load(row)
                                   : LoadPartial(row, count);
        }
        Transpose(r);
        for (int i = 0; i < count; ++i) {
          _mm256_storeu_ps(P + (j0 + i) * nt + c0, r[i]);
        }
      }
    }
    return (nc + kLanes - 1) / kLanes * kLanes;
  }

  template <class T>
  static void StorePartial(T* p, F v, int n) {
    if constexpr (std::is_same_v<T, float>) {
      _mm256_maskstore_ps(p, Mask(n), v);
    } else {
      alignas(16) T buf[kLanes];
      _mm_store_si128(reinterpret_cast<__m128i*>(buf), Narrow(v, T{}));
      std::memcpy(p, buf, n * sizeof(T));
    }
  }
};

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
