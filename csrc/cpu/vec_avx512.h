// AVX-512 vector policy for the kernel templates (bgmv_impl.h): 16 fp32 lanes,
// masked tails, and (with kBf16) AVX512-BF16 `vdpbf16ps` pair dot products.
// Include only from a TU compiled for AVX-512 (kernels_avx512*.cpp,
// kernels_amx*.cpp).
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

template <bool kBf16>
struct VecAvx512 {
  static constexpr int kLanes = 16;
  static constexpr bool kBf16Dot = kBf16;
  static constexpr int kTileM = 4;
  static constexpr int kTileN = 4;
  static constexpr int kSplitTileM = 4;
  static constexpr int kSplitTileN = 4;
  // Pack tiles of 4 tokens x 4 vectors: 16 of the 32 registers accumulate.
  static constexpr int kPackTileM = 4;
  static constexpr int kPackVectors = 4;
  static constexpr bool kGather = true;
  static constexpr bool kRowGroups = true;
  // bf16 weights split 32 at a time (LoadSplit) where there are no pair
  // products: see there.
  static constexpr bool kSplitBf16 = true;
  using F = __m512;

  static __mmask16 Mask16(int n) {
    return static_cast<__mmask16>((1u << n) - 1u);
  }
  static __mmask32 Mask32(int n) {
    return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1u);
  }

  // The rows-vs-pack rules of this ISA (tuning.h), with and without pair
  // products.
  static constexpr int64_t RowsMaxTokens(int64_t k, bool grouped,
                                         WeightProducts p) {
    return p == WeightProducts::kBf16Pairs
               ? ::vllm_cpu_lora::RowsMaxTokens(k, grouped)
               : RowsMaxTokensAvx512Fma(k, grouped, p);
  }

  static F Zero() { return _mm512_setzero_ps(); }
  static F Set1(float v) { return _mm512_set1_ps(v); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static float Reduce(F v) { return _mm512_reduce_add_ps(v); }

  // Lane j of the result = the sum of the lanes of acc[j]: a transpose-add
  // tree of 30 shuffles and 15 adds for 16 dot products at once.
  static F SumLanes(const F (&acc)[kLanes]) {
    F c[8], d[4], e[2];
    for (int i = 0; i < 8; ++i) {  // Per 128-bit lane: a02 b02 a13 b13.
      c[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                           _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) {  // Per 128-bit lane: rows 4i .. 4i + 3.
      const __m512d lo = _mm512_castps_pd(c[2 * i]);
      const __m512d hi = _mm512_castps_pd(c[2 * i + 1]);
      d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    for (int i = 0; i < 2; ++i) {  // 128-bit lanes summed in pairs.
      e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(d[2 * i], d[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(d[2 * i], d[2 * i + 1], 0xdd));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                         _mm512_shuffle_f32x4(e[0], e[1], 0xdd));
  }

  // Lane i of the result = the sum of lane group i % (16 / G) of
  // acc[i / (16 / G)], groups being G adjacent lanes, G in {4, 8}: the first
  // stages of SumLanes' tree, then one permutation into row order.
  template <int G>
  static F SumGroups(const F (&acc)[G]) {
    static_assert(G == 4 || G == 8);
    F c[G / 2], d[G / 4];
    for (int i = 0; i < G / 2; ++i) {
      c[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                           _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    }
    // d[i], 128-bit lane l: the sums over lane l of acc[4i] .. acc[4i + 3].
    for (int i = 0; i < G / 4; ++i) {
      const __m512d lo = _mm512_castps_pd(c[2 * i]);
      const __m512d hi = _mm512_castps_pd(c[2 * i + 1]);
      d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    if constexpr (G == 4) {
      // Lane 4l + m holds row 4m + l.
      const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6,
                                              10, 14, 3, 7, 11, 15);
      return _mm512_permutexvar_ps(order, d[0]);
    } else {
      // Rows are 256 bits: add the 128-bit lane pairs. Lane 4q + m then
      // holds row 2m + q (q < 2) or 8 + 2m + q - 2.
      const F e = _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                                _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
      const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9,
                                              13, 10, 14, 11, 15);
      return _mm512_permutexvar_ps(order, e);
    }
  }

  // p[0..G) repeated over the 16 lanes, G in {4, 8}.
  template <int G>
  static F Repeat(const float* p) {
    if constexpr (G == 4) {
      return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
    } else {
      return _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
    }
  }
  template <int G>
  static auto Repeat(const uint32_t* p) {
    __m512i v;
    if constexpr (G == 4) {
      v = _mm512_broadcast_i32x4(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      v = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    if constexpr (kBf16) {
      return (__m512bh)v;
    } else {
      return v;
    }
  }

  static F FromBf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }

  template <class T>
  static F Load(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_loadu_ps(p);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return FromBf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
      return _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
  }

  // Loads n < kLanes elements; the other lanes are zero and their memory is
  // not touched.
  template <class T>
  static F LoadPartial(const T* p, int n) {
    const __mmask16 m = Mask16(n);
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_maskz_loadu_ps(m, p);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return FromBf16(_mm256_maskz_loadu_epi16(m, p));
    } else {
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    }
  }

  // 32 elements as two fp32 vectors: the even-indexed ones and the
  // odd-indexed ones. For bf16 that is a shift and a mask of one 512-bit
  // load, half the work of widening 16 at a time, and products of such halves
  // summed over both are the dot product of the 32 (#avx512-split-bf16).
  struct Split {
    F even, odd;
  };
  template <class T>
  static Split LoadSplit(const T* p) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m512i v = _mm512_loadu_si512(p);
      return {Low(v, T{}), High(v, T{})};
    } else {
      const F a = Load(p), b = Load(p + kLanes);
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18,
                                             20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      return {_mm512_permutex2var_ps(a, even, b),
              _mm512_permutex2var_ps(a, odd, b)};
    }
  }
  // LoadSplit of the first n < 32 bf16 at p, the others zero (their memory
  // is not touched).
  static Split LoadSplitPartial(const c10::BFloat16* p, int n) {
    const __m512i v = _mm512_maskz_loadu_epi16(Mask32(n), p);
    return {Low(v, c10::BFloat16{}), High(v, c10::BFloat16{})};
  }
  // acc + the products of the halves of a and b.
  static F FmaSplit(const Split& a, const Split& b, F acc) {
    return Fma(a.odd, b.odd, Fma(a.even, b.even, acc));
  }

  // Round to nearest even, NaN kept quiet: the same rounding as
  // c10::BFloat16(float). With AVX512-BF16 one vcvtneps2bf16 (instead of
  // eight instructions), which differs only in flushing fp32 denormals
  // (below 1.2e-38) to zero.
  static __m256i ToBf16(F v) {
    if constexpr (kBf16) return (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(RoundToBf16High(v), 16));
  }
  // The rounding without AVX512-BF16: each lane's bf16 in its upper half.
  static __m512i RoundToBf16High(F v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb =
        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r =
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc00000));
  }

  // Stores 32 bf16 at p, element 2i from v.even[i] and 2i + 1 from v.odd[i],
  // rounded as Store rounds: the inverse of LoadSplit, one conversion and
  // one permutation (AVX512-BF16) or a word blend for 32 outputs
  // (#rank-one-split).
  static void StoreSplit(c10::BFloat16* p, const Split& v) {
    __m512i r;
    if constexpr (kBf16) {
      // Elements 0-15 the even halves, 16-31 the odd ones, then interleaved.
      const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(v.odd, v.even);
      const __m512i order = _mm512_set_epi16(
          31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
          22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      r = _mm512_permutexvar_epi16(order, halves);
    } else {
      r = _mm512_mask_blend_epi16(
          0x55555555u, RoundToBf16High(v.odd),
          _mm512_srli_epi32(RoundToBf16High(v.even), 16));
    }
    _mm512_storeu_si512(p, r);
  }

  template <class T>
  static __m256i ToHalfWidth(F v) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return ToBf16(v);
    } else {
      return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
  }

  template <class T>
  static void Store(T* p, F v) {
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(p, v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ToHalfWidth<T>(v));
    }
  }

  template <class T>
  static void StorePartial(T* p, F v, int n) {
    const __mmask16 m = Mask16(n);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(p, m, v);
    } else {
      _mm256_mask_storeu_epi16(p, m, ToHalfWidth<T>(v));
    }
  }

  // ---- bf16 pair dot products (kBf16Dot only) ----
  using BH = __m512bh;
  static constexpr int kPairLanes = 2 * kLanes;  // bf16 elements per BH.

  // 32 elements of T as bf16 (fp32 is rounded to nearest even).
  template <class T>
  static BH LoadPairs(const T* p) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return (BH)_mm512_loadu_si512(p);
    } else {
      static_assert(std::is_same_v<T, float>);
      return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
    }
  }

  template <class T>
  static BH LoadPairsPartial(const T* p, int n) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return (BH)_mm512_maskz_loadu_epi16(Mask32(n), p);
    } else {
      const int lo = n < 16 ? n : 16;
      const F a = _mm512_maskz_loadu_ps(Mask16(lo), p);
      const F b = n > 16 ? _mm512_maskz_loadu_ps(Mask16(n - 16), p + 16)
                         : _mm512_setzero_ps();
      return _mm512_cvtne2ps_pbh(b, a);
    }
  }

  static BH LoadPacked(const uint32_t* p) { return (BH)_mm512_loadu_si512(p); }
  static BH LoadPackedPartial(const uint32_t* p, int n) {
    return (BH)_mm512_maskz_loadu_epi32(Mask16(n), p);
  }
  static BH BroadcastPair(uint32_t pair) {
    return (BH)_mm512_set1_epi32(static_cast<int>(pair));
  }
  static F Dot(F acc, BH a, BH b) { return _mm512_dpbf16_ps(acc, a, b); }

  // ---- weight packing for the pack blocking ----
  // Packs columns c < nt of P (see PackKernel::Pack): row j holds, for each
  // weight row c < nc, element j (fp32) or the bf16 pair (2j, 2j+1) (kPairs),
  // zero for nc <= c < nc rounded up to kLanes (later columns are not read).
  // Returns the number of columns it packed, that rounded-up nc.
  //
  // Works on blocks of 16 weight rows x 8 dwords (16 bf16/fp16 or 8 fp32
  // elements): masked row loads, then an in-register 16 x 8 dword transpose
  // (24 shuffles) gives, per dword column, one vector across the 16 rows.
  // Gathers would be simpler but are several times slower on CPUs with the
  // Gather Data Sampling mitigation. Blocks of 16 rows of 1, 2, 4 or 8 whole
  // dwords back to back (vLLM's expand weights up to rank 16 in bf16 or fp16,
  // 8 in fp32) take SplitRows instead (#pack-split-rows).
  template <class TW, bool kPairs>
  static int PackColumns(const TW* w, int64_t row_stride, int64_t k, int nc,
                         int nt, void* out) {
    constexpr int kPerDword = sizeof(TW) == 2 ? 2 : 1;
    const int64_t dwords = (k + kPerDword - 1) / kPerDword;
    // Packed row d, columns [c0, c0 + 16): col.
    auto store = [&](int64_t d, int c0, __m512i col) {
      if constexpr (kPairs) {
        _mm512_storeu_si512(static_cast<uint32_t*>(out) + d * nt + c0, col);
      } else if constexpr (kPerDword == 1) {
        _mm512_storeu_ps(static_cast<float*>(out) + d * nt + c0,
                         _mm512_castsi512_ps(col));
      } else {
        float* P = static_cast<float*>(out) + c0;
        _mm512_storeu_ps(P + 2 * d * nt, Low(col, TW{}));
        if (2 * d + 1 < k)
          _mm512_storeu_ps(P + (2 * d + 1) * nt, High(col, TW{}));
      }
    };
    int c0 = 0;
    if (row_stride == k && k % kPerDword == 0 && dwords > 0 && dwords <= 8 &&
        (dwords & (dwords - 1)) == 0) {
      WithRowDwords(static_cast<int>(dwords), [&](auto row_dwords) {
        constexpr int kD = decltype(row_dwords)::value;
        for (; c0 + kLanes <= nc; c0 += kLanes) {
          SplitRows<kD>(w + c0 * row_stride,
                        [&](int d, __m512i col) { store(d, c0, col); });
        }
      });
    }
    for (; c0 < nc; c0 += kLanes) {
      for (int64_t d0 = 0; d0 < dwords; d0 += 8) {
        const int64_t e0 = d0 * kPerDword;  // First element of the block.
        const int count =
            static_cast<int>(std::min<int64_t>(8 * kPerDword, k - e0));
        auto load_row = [&](int r) -> __m256i {
          if (c0 + r >= nc) return _mm256_setzero_si256();
          const TW* p = w + (c0 + r) * row_stride + e0;
          if constexpr (kPerDword == 2) {
            return _mm256_maskz_loadu_epi16(
                static_cast<__mmask16>(Mask32(count)), p);
          } else {
            return _mm256_maskz_loadu_epi32(
                static_cast<__mmask8>(Mask16(count)), p);
          }
        };
        // z[i] = rows (i, i + 4) for i < 4 and (i + 4, i + 8) for i >= 4, so
        // that the transpose below leaves rows in lane order.
        __m512i z[8];
        for (int i = 0; i < 8; ++i) {
          const int lo = i < 4 ? i : i + 4;
          z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load_row(lo)),
                                    load_row(lo + 4), 1);
        }
        __m512i t[8], u[8];
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
        }
        for (int h = 0; h < 2; ++h) {
          const __m512i* th = t + 4 * h;
          u[4 * h + 0] = _mm512_unpacklo_epi64(th[0], th[2]);
          u[4 * h + 1] = _mm512_unpackhi_epi64(th[0], th[2]);
          u[4 * h + 2] = _mm512_unpacklo_epi64(th[1], th[3]);
          u[4 * h + 3] = _mm512_unpackhi_epi64(th[1], th[3]);
        }
        // u[q] (q < 4) holds dword columns q (128-bit lanes 0, 2) and q + 4
        // (lanes 1, 3) of rows 0-3 / 4-7; u[q + 4] the same for rows 8-15.
        const int64_t valid_dwords = std::min<int64_t>(8, dwords - d0);
        for (int q = 0; q < 8; ++q) {
          if (q >= valid_dwords) break;
          const __m512i col = q < 4
                                  ? _mm512_shuffle_i32x4(u[q], u[q + 4], 0x88)
                                  : _mm512_shuffle_i32x4(u[q - 4], u[q], 0xdd);
          store(d0 + q, c0, col);
        }
      }
    }
    return (nc + kLanes - 1) / kLanes * kLanes;
  }

  // fn(std::integral_constant<int, d>{}) for d = dwords, a power of two up
  // to 8.
  template <class Fn>
  static void WithRowDwords(int dwords, Fn&& fn) {
    switch (dwords) {
      case 1:
        return fn(std::integral_constant<int, 1>{});
      case 2:
        return fn(std::integral_constant<int, 2>{});
      case 4:
        return fn(std::integral_constant<int, 4>{});
      default:
        return fn(std::integral_constant<int, 8>{});
    }
  }

  // The 16 rows of D dwords back to back at p, D a power of two up to 8,
  // split into D vectors, vector d holding dword d of every row: store(d,
  // vector). Each round splits every run of vectors, a stream of rows of
  // `kRun` dwords, into its even dwords then its odd ones: D whole-vector
  // loads and D log2(D) two-source permutes in all, where the transpose
  // takes 16 masked loads, 8 inserts and up to 24 shuffles.
  template <int D, class Store>
  static void SplitRows(const void* p, Store&& store) {
    __m512i v[D];
    for (int i = 0; i < D; ++i) {
      v[i] = _mm512_loadu_si512(static_cast<const __m512i*>(p) + i);
    }
    SplitRounds<D, D>(v);
    // The rounds leave dword column d in the vector whose index is d's
    // log2(D) bits reversed.
    for (int i = 0; i < D; ++i) {
      int d = 0;
      for (int bit = 1; bit < D; bit *= 2) {
        if (i & bit) d |= D / 2 / bit;
      }
      store(d, v[i]);
    }
  }
  template <int D, int kRun>
  static void SplitRounds(__m512i (&v)[D]) {
    if constexpr (kRun > 1) {
      const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14,
                                            12, 10, 8, 6, 4, 2, 0);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      __m512i next[D];
      for (int g = 0; g < D; g += kRun) {
        for (int j = 0; j < kRun / 2; ++j) {
          const __m512i a = v[g + 2 * j], b = v[g + 2 * j + 1];
          next[g + j] = _mm512_permutex2var_epi32(a, even, b);
          next[g + kRun / 2 + j] = _mm512_permutex2var_epi32(a, odd, b);
        }
      }
      for (int i = 0; i < D; ++i) v[i] = next[i];
      SplitRounds<D, kRun / 2>(v);
    }
  }

  // The first / second 16-bit element of each dword, widened to fp32.
  static F Low(__m512i d, c10::BFloat16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
  }
  static F High(__m512i d, c10::BFloat16) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(d, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static F Low(__m512i d, c10::Half) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
  }
  static F High(__m512i d, c10::Half) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(d, 16)));
  }
};

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
