// The "rows" strategy (an expand of a few tokens per adapter): dot products
// along k over the weight rows in place, no repacking; each tile of rows,
// read once from memory, serves every token of the group from L1.
// Compiled once per ISA, inside its namespace (kernel_isa_namespace.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernel_common.h"
#include "kernel_interface.h"
#include "kernel_isa_namespace.h"
#include "tuning.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

template <class V, class TX, class TW, class TO>
struct RowsKernel : KernelTypes<V, TX, TW, TO> {
  using Base = KernelTypes<V, TX, TW, TO>;
  static constexpr auto kL = Base::kL;
  static constexpr auto kPairs = Base::kPairs;
  static constexpr auto kSplit = Base::kSplit;
  static constexpr auto kSplitElems = Base::kSplitElems;
  using Base::StoreVec;
  using typename Base::F;
  using typename Base::PackT;

  // A vector of inputs or weights as the products take it: bf16 pairs
  // (kPairs) or fp32 lanes.
  using PV = typename PairVec<V, kPairs>::Type;

  // Weight or input elements per PV.
  static constexpr int LoadElems() {
    if constexpr (kPairs) {
      return V::kPairLanes;
    } else {
      return kL;
    }
  }

  // LoadElems() weights from p, or (partial) its first n.
  static PV LoadW(const TW* p) {
    if constexpr (kPairs) {
      return V::LoadPairs(p);
    } else {
      return V::Load(p);
    }
  }
  static PV LoadWPartial(const TW* p, int n) {
    if constexpr (kPairs) {
      return V::LoadPairsPartial(p, n);
    } else {
      return V::LoadPartial(p, n);
    }
  }

  // LoadElems() converted inputs from element e of xc, or (partial) n.
  static PV LoadX(const PackT* xc, int64_t e) {
    if constexpr (kPairs) {
      return V::LoadPacked(xc + e / 2);
    } else {
      return V::Load(xc + e);
    }
  }
  static PV LoadXPartial(const PackT* xc, int64_t e, int n) {
    if constexpr (kPairs) {
      return V::LoadPackedPartial(xc + e / 2, (n + 1) / 2);
    } else {
      return V::LoadPartial(xc + e, n);
    }
  }

  // acc + the lane-wise products of x and w (pair products with kPairs).
  static F MulAdd(F acc, PV x, PV w) {
    if constexpr (kPairs) {
      return V::Dot(acc, x, w);
    } else {
      return V::Fma(x, w, acc);
    }
  }

  // One token's converted inputs xc (rows entries) against weight rows
  // [n, n + kL) read in place: kL dot products along k, turned into kL
  // adjacent outputs by V::SumLanes. Rows at or past n + nr (nr <= kL) repeat
  // row n + nr - 1; their lanes are dropped by the store. For groups of a
  // token or two this beats repacking, whose transposes would serve too few
  // tokens.
  static F RowsTile(const LoraArgs& a, const TW* wa, const PackT* xc, int64_t n,
                    int nr) {
    const int64_t k = a.k;
    F acc[kL];
    // One row at a time, its whole reduction: a single live pointer, and
    // the inputs are re-read from L1.
    for (int j = 0; j < kL; ++j) {
      const TW* row = wa + (n + std::min(j, nr - 1)) * a.w_row_stride;
      F s = V::Zero();
      int64_t kk = 0;
      if constexpr (kSplit) {
        for (; kk + kSplitElems <= k; kk += kSplitElems)
          s = V::FmaSplit(V::LoadSplit(xc + kk), V::LoadSplit(row + kk), s);
      }
      for (; kk + LoadElems() <= k; kk += LoadElems())
        s = MulAdd(s, LoadX(xc, kk), LoadW(row + kk));
      if (kk < k) {
        const int rest = static_cast<int>(k - kk);
        s = MulAdd(s, LoadXPartial(xc, kk, rest), LoadWPartial(row + kk, rest));
      }
      acc[j] = s;
    }
    return V::SumLanes(acc);
  }

  // RowsTile for whole tiles (kL rows) of contiguous rows of exactly kK
  // elements: every load is at a constant offset from `tile`, and the
  // accumulators stay in registers.
  template <int kK>
  static F RowsTileFixed(const TW* tile, const PackT* xc) {
    constexpr int kS = LoadElems();
    static_assert(kK % kS == 0);
    F acc[kL];
    for (int j = 0; j < kL; ++j) acc[j] = V::Zero();
    if constexpr (kSplit && kK % kSplitElems == 0) {
#pragma GCC unroll 8
      for (int kk = 0; kk < kK; kk += kSplitElems) {
        const typename V::Split xv = V::LoadSplit(xc + kk);
#pragma GCC unroll 16
        for (int j = 0; j < kL; ++j)
          acc[j] = V::FmaSplit(xv, V::LoadSplit(tile + j * kK + kk), acc[j]);
      }
    } else {
#pragma GCC unroll 8
      for (int kk = 0; kk < kK; kk += kS) {
        const PV xv = LoadX(xc, kk);
#pragma GCC unroll 16
        for (int j = 0; j < kL; ++j)
          acc[j] = MulAdd(acc[j], xv, LoadW(tile + j * kK + kk));
      }
    }
    return V::SumLanes(acc);
  }

  // The operands of the grouped tiles: with kSplit the even and odd halves
  // of bf16 rows (V::Split, GroupElems() elements), else PVs.
  using GV = typename SplitVec<V, kSplit, PV>::Type;
  static constexpr int GroupElems() {
    return kSplit ? kSplitElems : LoadElems();
  }

  // Elements of a weight row of G lanes: pairs or halves hold two a lane.
  template <int G>
  static constexpr int64_t GroupRowElems() {
    return (kPairs || kSplit) ? 2 * G : G;
  }

  // Lanes per weight row when several short rows share a vector (G of the
  // kL lanes each: bf16 pairs or halves, or fp32 elements), 0 where that
  // does not apply: the rows must be contiguous and G in {4, 8}, less than
  // kL (V::SumGroups).
  static int RowGroupLanes(const LoraArgs& a) {
    if constexpr (!V::kRowGroups) {
      return 0;
    } else {
      constexpr int64_t kLaneElems = GroupRowElems<1>();
      const int64_t lanes = a.k / kLaneElems;
      const bool fits = (lanes == 4 || lanes == 8) && lanes < kL &&
                        a.k % kLaneElems == 0 && a.w_row_stride == a.k;
      return fits ? static_cast<int>(lanes) : 0;
    }
  }

  // A token's inputs (k = 2G with kSplit, else G entries of xc) repeated once
  // per row of a GV.
  template <int G>
  static GV RepeatInputs(const PackT* xc) {
    if constexpr (kSplit) {
      float even[G], odd[G];
      for (int g = 0; g < G; ++g) {
        even[g] = xc[2 * g];
        odd[g] = xc[2 * g + 1];
      }
      return {V::template Repeat<G>(even), V::template Repeat<G>(odd)};
    } else {
      return V::template Repeat<G>(xc);
    }
  }

  // The lane-wise products of a GV of inputs and the weights at p, of which
  // only the first `valid` elements are read.
  static F GroupProducts(const GV& x, const TW* p, int64_t valid) {
    constexpr int kElems = GroupElems();
    const int n = static_cast<int>(std::clamp<int64_t>(valid, 0, kElems));
    if constexpr (kSplit) {
      const typename V::Split w =
          n == kElems ? V::LoadSplit(p) : V::LoadSplitPartial(p, n);
      return V::FmaSplit(x, w, V::Zero());
    } else {
      return MulAdd(V::Zero(), x, n == kElems ? LoadW(p) : LoadWPartial(p, n));
    }
  }

  // RowsTile for short contiguous rows, kL / G rows per GV: G of them hold
  // the kL rows [n, n + kL) (elements past row n + nr are not read), one
  // product each with the token's inputs repeated per row (xr), and
  // V::SumGroups sums each row's G lanes into its output lane.
  template <int G>
  static F RowsGroupTile(const TW* wa, int64_t n, int nr, const GV& xr) {
    constexpr int64_t k = GroupRowElems<G>();
    const TW* tile = wa + n * k;
    const int64_t valid = nr * k;
    F acc[G];
    for (int q = 0; q < G; ++q) {
      acc[q] =
          GroupProducts(xr, tile + q * GroupElems(), valid - q * GroupElems());
    }
    return V::template SumGroups<G>(acc);
  }

  // The rows tiles over columns [n0, n1) for `count` <= kRowsMaxTokens
  // tokens (inputs xc): each tile of weight rows, read once from memory,
  // serves every token from L1.
  static void Run(const LoraArgs& a, const TW* wa, const PackT* xc,
                  int64_t rows, const int64_t* tok, int64_t count, int64_t n0,
                  int64_t n1, int group_lanes) {
    // kG: grouped tiles of kG lanes per row; else kK > 0: whole tiles of
    // contiguous kK-element rows through RowsTileFixed.
    auto sweep = [&](auto lanes, auto fixed_k) {
      constexpr int kG = decltype(lanes)::value;
      constexpr int kK = decltype(fixed_k)::value;
      // The pointers as locals, not captures: the vector stores may alias
      // anything, and captured pointers were reloaded after each of them.
      const TW* const w = wa;
      const PackT* const x = xc;
      const int64_t* const tokens = tok;
      TO* const out = static_cast<TO*>(a.out);
      // The inputs repeated once per row of a GV (grouped tiles only).
      GV xr[kRowsMaxTokens];
      if constexpr (kG > 0) {
        for (int64_t i = 0; i < count; ++i)
          xr[i] = RepeatInputs<kG>(x + i * rows);
      }
      int64_t n = n0;
      if constexpr ((kG > 0 || kK > 0) && RowsTwoTiles(kL, kK, kG > 0)) {
        // Rows [m, m + 2 kL) of kRowElems elements, contiguous: their bytes
        // kRowsPrefetchBytes ahead, into L2. The addresses are integers:
        // they may lie past the weights, where a prefetch is harmless but a
        // pointer may not point.
        constexpr int64_t kRowElems = kG > 0 ? GroupRowElems<kG>() : kK;
        constexpr int64_t kStepBytes = 2 * kL * kRowElems * int64_t{sizeof(TW)};
        auto prefetch = [&](int64_t m) {
          const uintptr_t p = reinterpret_cast<uintptr_t>(w + m * kRowElems) +
                              kRowsPrefetchBytes;
          for (int64_t b = 0; b < kStepBytes; b += kCacheLineBytes)
            __builtin_prefetch(reinterpret_cast<const void*>(p + b), 0, 2);
        };
        // Token i's whole tile of rows [m, m + kL).
        auto whole_tile = [&](int64_t m, int64_t i) {
          if constexpr (kG > 0) {
            return RowsGroupTile<kG>(w, m, kL, xr[i]);
          } else {
            return RowsTileFixed<kK>(w + m * kK, x + i * rows);
          }
        };
        for (; n + 2 * kL <= n1; n += 2 * kL) {
          prefetch(n);
          for (int64_t i = 0; i < count; ++i) {
            const F r0 = whole_tile(n, i);
            const F r1 = whole_tile(n + kL, i);
            TO* o = out + tokens[i] * a.out_row_stride + n;
            Base::StoreVec(a, o, r0, kL);
            Base::StoreVec(a, o + kL, r1, kL);
          }
        }
      }
      for (; n < n1; n += kL) {
        const int nr = static_cast<int>(std::min<int64_t>(kL, n1 - n));
        for (int64_t i = 0; i < count; ++i) {
          F r;
          if constexpr (kG > 0) {
            r = RowsGroupTile<kG>(w, n, nr, xr[i]);
          } else if constexpr (kK > 0) {
            r = nr == kL ? RowsTileFixed<kK>(w + n * kK, x + i * rows)
                         : RowsTile(a, w, x + i * rows, n, nr);
          } else {
            r = RowsTile(a, w, x + i * rows, n, nr);
          }
          StoreVec(a, out + tokens[i] * a.out_row_stride + n, r, nr);
        }
      }
    };
    using std::integral_constant;
    using kNone = integral_constant<int, 0>;
    if constexpr (V::kRowGroups) {
      if (group_lanes == 4) return sweep(integral_constant<int, 4>{}, kNone{});
      if constexpr (kL > 8) {
        if (group_lanes == 8) {
          return sweep(integral_constant<int, 8>{}, kNone{});
        }
      }
    }
    if (a.w_row_stride == a.k) {
      switch (a.k) {
        case 8:  // Ungrouped where 8 elements fill a vector or more.
          if constexpr (kL <= 8) {
            return sweep(kNone{}, integral_constant<int, 8>{});
          }
          break;
        case 16:  // Ungrouped where 16 elements fill vectors (fp16, fp32).
          if constexpr (16 % LoadElems() == 0) {
            return sweep(kNone{}, integral_constant<int, 16>{});
          }
          break;
        case 32:
          return sweep(kNone{}, integral_constant<int, 32>{});
        case 64:
          return sweep(kNone{}, integral_constant<int, 64>{});
        case 128:
          return sweep(kNone{}, integral_constant<int, 128>{});
        case 256:
          return sweep(kNone{}, integral_constant<int, 256>{});
      }
    }
    sweep(kNone{}, kNone{});
  }
};

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
