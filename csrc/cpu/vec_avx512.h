// AVX-512 vector policy for bgmv_impl.h: 16 fp32 lanes, masked tails, and
// (with kBf16) AVX512-BF16 `vdpbf16ps` pair dot products. Include only from
// a TU compiled for AVX-512 (see kernels_avx512*.cpp), inside its ISA
// namespace.
#pragma once

template <bool kBf16>
struct VecAvx512 {
  static constexpr int kLanes = 16;
  static constexpr bool kBf16Dot = kBf16;
  static constexpr int kTileM = 4;
  static constexpr int kTileN = 4;
  static constexpr bool kGather = true;
  using F = __m512;

  static __mmask16 Mask16(int n) {
    return static_cast<__mmask16>((1u << n) - 1u);
  }
  static __mmask32 Mask32(int n) {
    return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1u);
  }

  static F Zero() { return _mm512_setzero_ps(); }
  static F Set1(float v) { return _mm512_set1_ps(v); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static float Reduce(F v) { return _mm512_reduce_add_ps(v); }

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

  // Round to nearest even, NaN kept quiet: the same rounding as
  // c10::BFloat16(float).
  static __m256i ToBf16(F v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb =
        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(
        u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
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

  static BH LoadPacked(const uint32_t* p) {
    return (BH)_mm512_loadu_si512(p);
  }
  static BH BroadcastPair(uint32_t pair) {
    return (BH)_mm512_set1_epi32(static_cast<int>(pair));
  }
  static F Dot(F acc, BH a, BH b) { return _mm512_dpbf16_ps(acc, a, b); }

  // ---- weight packing for the pack blocking, by gathers ----
  // Packs columns c < nt of P (see LoraKernel::Pack): row j holds, for each
  // weight row c < nc, element j (fp32) or the bf16 pair (2j, 2j+1) (kPairs),
  // zero for c >= nc. Returns how many columns it packed: nt, or 0 where it
  // leaves the work to the generic loop.
  template <class TW, bool kPairs>
  static int PackColumns(const TW* w, int64_t row_stride, int64_t k, int nc,
                         int nt, void* out) {
    const int64_t max_offset = static_cast<int64_t>(nt) * row_stride * 4;
    if (k < 2 && !std::is_same_v<TW, float>) return 0;
    if (max_offset > INT32_MAX) return 0;
    const char* base = reinterpret_cast<const char*>(w);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                           11, 12, 13, 14, 15);
    const int row_bytes = static_cast<int>(row_stride * sizeof(TW));
    for (int c0 = 0; c0 < nt; c0 += kLanes) {
      const int valid = std::max(0, std::min(kLanes, nc - c0));
      const __mmask16 m = Mask16(valid);
      const __m512i vidx = _mm512_mullo_epi32(
          _mm512_add_epi32(lane, _mm512_set1_epi32(c0)),
          _mm512_set1_epi32(row_bytes));
      auto gather = [&](int64_t elem) {
        return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, vidx,
                                           base + elem * sizeof(TW), 1);
      };
      if constexpr (kPairs) {
        uint32_t* P = static_cast<uint32_t*>(out) + c0;
        for (int64_t j = 0; j < k / 2; ++j)
          _mm512_storeu_si512(P + j * nt, gather(2 * j));
        if (k % 2)
          _mm512_storeu_si512(P + (k / 2) * nt,
                              _mm512_srli_epi32(gather(k - 2), 16));
      } else {
        float* P = static_cast<float*>(out) + c0;
        if constexpr (std::is_same_v<TW, float>) {
          for (int64_t j = 0; j < k; ++j)
            _mm512_storeu_ps(P + j * nt, _mm512_castsi512_ps(gather(j)));
        } else {
          for (int64_t j = 0; j + 1 < k; j += 2) {
            const __m512i d = gather(j);
            _mm512_storeu_ps(P + j * nt, Low(d, TW{}));
            _mm512_storeu_ps(P + (j + 1) * nt, High(d, TW{}));
          }
          if (k % 2) _mm512_storeu_ps(P + (k - 1) * nt, High(gather(k - 2), TW{}));
        }
      }
    }
    return nt;
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
