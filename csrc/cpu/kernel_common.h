// What the kernel strategies (kernel_dot.h, kernel_rows.h, kernel_pack.h,
// bgmv_amx.h) share: dispatch on the element types, the types and constants
// of one kernel instance (vector policy V, element types of x, w and out),
// the input conversion and the vector store. Compiled once per ISA, inside its
// namespace (kernel_isa_namespace.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>

#include "kernel_interface.h"
#include "kernel_isa_namespace.h"
#include "tuning.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

template <class T>
struct TypeOf;
template <>
struct TypeOf<float> {
  static constexpr DType kValue = DType::kFloat;
};
template <>
struct TypeOf<c10::BFloat16> {
  static constexpr DType kValue = DType::kBFloat16;
};
template <>
struct TypeOf<c10::Half> {
  static constexpr DType kValue = DType::kHalf;
};

template <class Fn>
void WithType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat:
      fn(float{});
      break;
    case DType::kBFloat16:
      fn(c10::BFloat16{});
      break;
    case DType::kHalf:
      fn(c10::Half{});
      break;
  }
}

// Calls fn(TX{}, TW{}, TO{}) with the element types of `args`.
template <class Fn>
void WithTypes(const LoraArgs& args, Fn&& fn) {
  WithType(args.x_dtype, [&](auto tx) {
    WithType(args.w_dtype, [&](auto tw) {
      WithType(args.out_dtype, [&](auto to) { fn(tx, tw, to); });
    });
  });
}

// Rounds v to bf16 and returns its bits (c10 rounding: nearest even).
template <class T>
inline uint16_t Bf16Bits(T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return v.x;
  } else {
    const c10::BFloat16 b(static_cast<float>(v));
    return b.x;
  }
}

// The vector type of bf16 pairs where the policy has one (kPairs), else F.
template <class V, bool kPairs>
struct PairVec {
  using Type = typename V::F;
};
template <class V>
struct PairVec<V, true> {
  using Type = typename V::BH;
};

// V::Split where bf16 weights are split (kSplit), else PV.
template <class V, bool kSplit, class PV>
struct SplitVec {
  using Type = PV;
};
template <class V, class PV>
struct SplitVec<V, true, PV> {
  using Type = typename V::Split;
};

constexpr int64_t kCacheLineBytes = 64;

// Buffers whose rows the AMX tiles and vector loads read as whole cache
// lines: `new` aligns to 16 bytes only, so 64-byte rows would straddle two
// lines each (#aligned-buffers).
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
using AlignedArray = std::unique_ptr<T[], FreeDeleter>;
template <class T>
AlignedArray<T> NewAligned(int64_t count) {
  constexpr size_t kLine = kCacheLineBytes;
  const size_t bytes =
      (std::max<size_t>(count * sizeof(T), 1) + kLine - 1) / kLine * kLine;
  void* p = std::aligned_alloc(kLine, bytes);
  if (p == nullptr) throw std::bad_alloc();
  return AlignedArray<T>(static_cast<T*>(p));
}

// A work item's packed weight blocks, kept for the next item: a run of
// items over the same adapter and columns (launch.cpp orders them so)
// packs once.
template <class T>
class PackedBlocks {
 public:
  // Whether the caller must pack the blocks of columns [n0, n1) of the
  // adapter weights w into data(): false where the buffer holds them
  // already; else it is made `size` entries or more and taken to hold them.
  bool NeedsPacking(const void* w, int64_t n0, int64_t n1, int64_t size) {
    if (w == w_ && n0 == n0_ && n1 == n1_) return false;
    if (size > size_) {
      data_ = NewAligned<T>(size);
      size_ = size;
    }
    w_ = w;
    n0_ = n0;
    n1_ = n1;
    return true;
  }
  T* data() const { return data_.get(); }

 private:
  AlignedArray<T> data_;
  int64_t size_ = 0;
  const void* w_ = nullptr;
  int64_t n0_ = 0, n1_ = 0;
};

// The dot tile (tokens kM x weight rows kN) of policy V: its own shape for
// split bf16 operands, which take two registers each.
template <class V, bool kSplit>
struct DotTileShape {
  static constexpr int kM = V::kTileM, kN = V::kTileN;
};
template <class V>
struct DotTileShape<V, true> {
  static constexpr int kM = V::kSplitTileM, kN = V::kSplitTileN;
};

template <class V, class TX, class TW, class TO>
struct KernelTypes {
  using F = typename V::F;
  static constexpr int kL = V::kLanes;

  // bf16 pair products (vdpbf16ps) instead of fp32 FMAs.
  static constexpr bool kPairs =
      V::kBf16Dot && std::is_same_v<TW, c10::BFloat16> &&
      (std::is_same_v<TX, c10::BFloat16> ||
       (std::is_same_v<TX, float> && std::is_same_v<TO, c10::BFloat16>));

  // bf16 weights read 2 * kL at a time as even and odd halves (V::LoadSplit)
  // where the policy has no pair products.
  static constexpr bool kSplit =
      !kPairs && V::kSplitBf16 && std::is_same_v<TW, c10::BFloat16>;
  static constexpr int kSplitElems = 2 * kL;

  // Tokens and weight rows per dot tile.
  static constexpr int kTM = DotTileShape<V, kSplit>::kM;
  static constexpr int kTN = DotTileShape<V, kSplit>::kN;

  static constexpr WeightProducts kProducts =
      kPairs                      ? WeightProducts::kBf16Pairs
      : kSplit                    ? WeightProducts::kBf16Halves
      : std::is_same_v<TW, float> ? WeightProducts::kFp32
                                  : WeightProducts::kWidened;

  // Converted inputs and packed weights: fp32, or bf16 pairs (kPairs).
  using PackT = std::conditional_t<kPairs, uint32_t, float>;

  // Whether the rows of x are their converted inputs already: bf16 pairs in
  // memory order.
  static bool InputsArePairs(const LoraArgs& a) {
    return kPairs && std::is_same_v<TX, c10::BFloat16> && a.k % 2 == 0;
  }

  // Whether the pack tiles can read those pairs in place, tokens tok[0..count)
  // as consecutive rows of x, each pair aligned as one.
  static bool PairsInPlace(const LoraArgs& a, const int64_t* tok,
                           int64_t count) {
    return InputsArePairs(a) && a.x_row_stride % 2 == 0 &&
           reinterpret_cast<uintptr_t>(a.x) % sizeof(PackT) == 0 &&
           std::adjacent_find(tok, tok + count, [](int64_t t, int64_t next) {
             return next != t + 1;
           }) == tok + count;
  }

  // xc[i * rows + j] = input j of token tok[i] as fp32, or (kPairs) the bf16
  // pair (2j, 2j + 1) of it, for i < count.
  static void ConvertInputs(const LoraArgs& a, const int64_t* tok,
                            int64_t count, PackT* xc) {
    const TX* x = static_cast<const TX*>(a.x);
    const int64_t rows = kPairs ? (a.k + 1) / 2 : a.k;
    for (int64_t i = 0; i < count; ++i) {
      const TX* xr = x + tok[i] * a.x_row_stride;
      PackT* dst = xc + i * rows;
      if (InputsArePairs(a)) {
        std::memcpy(dst, xr, a.k * sizeof(TX));
        continue;
      }
      for (int64_t j = 0; j < rows; ++j) {
        if constexpr (kPairs) {
          const uint32_t lo = Bf16Bits(xr[2 * j]);
          const uint32_t hi = 2 * j + 1 < a.k ? Bf16Bits(xr[2 * j + 1]) : 0u;
          dst[j] = lo | (hi << 16);
        } else {
          dst[j] = static_cast<float>(xr[j]);
        }
      }
    }
  }

  // o[0..nc) = scale * r (+ o), nc <= kL.
  static void StoreVec(const LoraArgs& a, TO* o, F r, int nc) {
    r = V::Mul(r, V::Set1(a.scale));
    if (nc >= kL) {
      if (a.add) r = V::Add(r, V::Load(o));
      V::Store(o, r);
    } else {
      if (a.add) r = V::Add(r, V::LoadPartial(o, nc));
      V::StorePartial(o, r, nc);
    }
  }
};

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
