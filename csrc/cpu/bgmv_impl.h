// Kernel templates for the LoRA products
//   out[t, n] = scale * sum_k x[t, k] * w[a, n, k]  (+ out[t, n])
// parameterised by a vector policy V (one per ISA: vec_avx512.h, vec_avx2.h,
// vec_scalar.h) and the element types of x, w and out.
//
// Include inside the ISA's own namespace, after its vector policy, in a TU
// compiled for that ISA (kernels_<isa>.cpp): each ISA gets its own copy of
// every template, so nothing compiled for one ISA is shared with another.
//
// Arithmetic: products of the operands as given, fp32 accumulation, one
// rounding to the output type. One exception, as in vLLM's torch ops (which
// cast inputs to the output dtype): with bf16 weights and bf16 output, fp32
// inputs are rounded to bf16 so AVX512-BF16 / AMX pair products can be used.
#pragma once

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
  const c10::BFloat16 b(static_cast<float>(v));
  return b.x;
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

template <class V, class TX, class TW, class TO>
struct LoraKernel {
  using F = typename V::F;
  static constexpr int kL = V::kLanes;
  static constexpr int kTM = V::kTileM;  // Tokens per register tile.
  static constexpr int kTN = V::kTileN;  // Weight rows per dot tile.
  static constexpr int kNV = 4;          // Vectors per pack tile row.
  static constexpr int kNT = kNV * kL;   // Output columns per pack tile.

  // bf16 pair products (vdpbf16ps) instead of fp32 FMAs.
  static constexpr bool kPairs =
      V::kBf16Dot && std::is_same_v<TW, c10::BFloat16> &&
      (std::is_same_v<TX, c10::BFloat16> ||
       (std::is_same_v<TX, float> && std::is_same_v<TO, c10::BFloat16>));

  static void StoreScalar(const LoraArgs& a, TO* o, float v) {
    v *= a.scale;
    if (a.add) v += static_cast<float>(*o);
    *o = static_cast<TO>(v);
  }

  // ---------------------------------------------------------------- dot --
  // res[i][j] = sum_k xr[i][k] * wr[j][k].
  template <int MT, int NR>
  static void DotTile(const TX* const* xr, const TW* const* wr, int64_t k,
                      float (&res)[MT][NR]) {
    F acc[MT][NR];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = V::Zero();
    int64_t kk = 0;
    if constexpr (kPairs) {
      constexpr int kS = V::kPairLanes;
      for (; kk + kS <= k; kk += kS) {
        typename V::BH xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = V::LoadPairs(xr[i] + kk);
        for (int j = 0; j < NR; ++j) {
          const typename V::BH wv = V::LoadPairs(wr[j] + kk);
          for (int i = 0; i < MT; ++i) acc[i][j] = V::Dot(acc[i][j], xv[i], wv);
        }
      }
      if (kk < k) {
        const int n = static_cast<int>(k - kk);
        typename V::BH xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = V::LoadPairsPartial(xr[i] + kk, n);
        for (int j = 0; j < NR; ++j) {
          const typename V::BH wv = V::LoadPairsPartial(wr[j] + kk, n);
          for (int i = 0; i < MT; ++i) acc[i][j] = V::Dot(acc[i][j], xv[i], wv);
        }
      }
    } else {
      for (; kk + kL <= k; kk += kL) {
        F xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = V::Load(xr[i] + kk);
        for (int j = 0; j < NR; ++j) {
          const F wv = V::Load(wr[j] + kk);
          for (int i = 0; i < MT; ++i) acc[i][j] = V::Fma(xv[i], wv, acc[i][j]);
        }
      }
      if (kk < k) {
        const int n = static_cast<int>(k - kk);
        F xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = V::LoadPartial(xr[i] + kk, n);
        for (int j = 0; j < NR; ++j) {
          const F wv = V::LoadPartial(wr[j] + kk, n);
          for (int i = 0; i < MT; ++i) acc[i][j] = V::Fma(xv[i], wv, acc[i][j]);
        }
      }
    }
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NR; ++j) res[i][j] = V::Reduce(acc[i][j]);
  }

  // Tokens tok[0..MT) against weight rows [n0, n1) of one adapter.
  template <int MT, int NR>
  static void DotBlock(const LoraArgs& a, const TW* wa, const int64_t* tok,
                       int64_t n0, int64_t n1) {
    const TX* x = static_cast<const TX*>(a.x);
    TO* out = static_cast<TO*>(a.out);
    const TX* xr[MT];
    for (int i = 0; i < MT; ++i) xr[i] = x + tok[i] * a.x_row_stride;
    for (int64_t n = n0; n < n1; n += NR) {
      const int nr = static_cast<int>(std::min<int64_t>(NR, n1 - n));
      // Rows past the end repeat the last valid one; their sums are dropped.
      const TW* wr[NR];
      for (int j = 0; j < NR; ++j)
        wr[j] = wa + (n + std::min(j, nr - 1)) * a.w_row_stride;
      float res[MT][NR];
      DotTile<MT, NR>(xr, wr, a.k, res);
      for (int i = 0; i < MT; ++i) {
        TO* o = out + tok[i] * a.out_row_stride + n;
        for (int j = 0; j < nr; ++j) StoreScalar(a, o + j, res[i][j]);
      }
    }
  }

  static void RunDot(const LoraArgs& a, const WorkItem* items, int64_t begin,
                     int64_t end) {
    const TW* w = static_cast<const TW*>(a.w);
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const Group& g = a.groups[item.group];
      const int64_t* tok = a.tokens + g.token_begin;
      const TW* wa = w + g.adapter * a.w_adapter_stride;
      int64_t m = item.m0;
      for (; m + kTM <= item.m1; m += kTM)
        DotBlock<kTM, kTN>(a, wa, tok + m, item.n0, item.n1);
      // Two tokens share each weight load (adapters with 2-3 tokens are
      // common in decode batches).
      if constexpr (kTM > 2) {
        for (; m + 2 <= item.m1; m += 2)
          DotBlock<2, 2 * kTN>(a, wa, tok + m, item.n0, item.n1);
      }
      for (; m < item.m1; ++m)
        DotBlock<1, 2 * kTN>(a, wa, tok + m, item.n0, item.n1);
    }
  }

  // --------------------------------------------------------------- pack --
  // Packed weights: per k-row (or bf16 pair of k-rows) kNT output columns.
  using PackT = std::conditional_t<kPairs, uint32_t, float>;
  static constexpr int64_t kPackRows = kPairs ? kMaxPackK / 2 : kMaxPackK;

  // P[j * kNT + c] = w[c][j] for c < nc (bf16 pairs: w[c][2j], w[c][2j+1]),
  // zero for nc <= c < nc rounded up to kL; later columns are never read.
  static void Pack(const TW* w, int64_t row_stride, int64_t k, int nc,
                   PackT* P) {
    const int64_t rows = kPairs ? (k + 1) / 2 : k;
    int c0 = 0;
    if constexpr (V::kGather) {
      c0 = V::template PackColumns<TW, kPairs>(w, row_stride, k, nc, kNT, P);
    }
    const int filled = (nc + kL - 1) / kL * kL;
    for (int c = c0; c < filled; ++c) {
      const TW* row = w + c * row_stride;
      for (int64_t j = 0; j < rows; ++j) {
        PackT v{};
        if (c < nc) {
          if constexpr (kPairs) {
            const uint32_t lo = row[2 * j].x;
            const uint32_t hi = 2 * j + 1 < k ? row[2 * j + 1].x : 0u;
            v = lo | (hi << 16);
          } else {
            v = static_cast<float>(row[j]);
          }
        }
        P[j * kNT + c] = v;
      }
    }
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

  // out rows tok[0..MT), columns [n, n + nc): the packed block P times the
  // converted inputs xc (rows entries per token). kFull: nc == kNT, known at
  // compile time so the accumulators stay in registers.
  template <int MT, bool kFull>
  static void PackTile(const LoraArgs& a, const PackT* P, const PackT* xc,
                       int64_t rows, const int64_t* tok, int64_t n, int nc) {
    TO* out = static_cast<TO*>(a.out);
    const int nv = kFull ? kNV : (nc + kL - 1) / kL;  // Vectors in use.
    F acc[MT][kNV];
    for (int i = 0; i < MT; ++i)
      for (int v = 0; v < kNV; ++v) acc[i][v] = V::Zero();
    for (int64_t j = 0; j < rows; ++j) {
      const PackT* pj = P + j * kNT;
      if constexpr (kPairs) {
        typename V::BH wv[kNV];
        for (int v = 0; v < kNV; ++v)
          if (v < nv) wv[v] = V::LoadPacked(pj + v * kL);
        for (int i = 0; i < MT; ++i) {
          const typename V::BH xb = V::BroadcastPair(xc[i * rows + j]);
          for (int v = 0; v < kNV; ++v)
            if (v < nv) acc[i][v] = V::Dot(acc[i][v], xb, wv[v]);
        }
      } else {
        F wv[kNV];
        for (int v = 0; v < kNV; ++v)
          if (v < nv) wv[v] = V::Load(pj + v * kL);
        for (int i = 0; i < MT; ++i) {
          const F xb = V::Set1(xc[i * rows + j]);
          for (int v = 0; v < kNV; ++v)
            if (v < nv) acc[i][v] = V::Fma(xb, wv[v], acc[i][v]);
        }
      }
    }
    for (int i = 0; i < MT; ++i) {
      StoreRow(a, out + tok[i] * a.out_row_stride + n, acc[i], nc);
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

  // o[0..nc) = scale * acc (+ o), nc <= kNT.
  static void StoreRow(const LoraArgs& a, TO* o, const F (&acc)[kNV], int nc) {
    for (int v = 0; v < kNV && v * kL < nc; ++v) {
      StoreVec(a, o + v * kL, acc[v], nc - v * kL);
    }
  }

  // -------------------------------------------------------------- rows --
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
#pragma GCC unroll 8
    for (int kk = 0; kk < kK; kk += kS) {
      const PV xv = LoadX(xc, kk);
#pragma GCC unroll 16
      for (int j = 0; j < kL; ++j)
        acc[j] = MulAdd(acc[j], xv, LoadW(tile + j * kK + kk));
    }
    return V::SumLanes(acc);
  }

  // Lanes per weight row when several short rows share a vector (G of the
  // kL lanes each: bf16 pairs, or fp32 elements), 0 where that does not
  // apply: the rows must be contiguous and G in {4, 8} (V::SumGroups).
  static int RowGroupLanes(const LoraArgs& a) {
    if constexpr (!V::kRowGroups) {
      return 0;
    } else {
      const int64_t lanes = kPairs ? a.k / 2 : a.k;
      const bool fits = (lanes == 4 || lanes == 8) &&
                        (!kPairs || a.k % 2 == 0) && a.w_row_stride == a.k;
      return fits ? static_cast<int>(lanes) : 0;
    }
  }

  // RowsTile for short contiguous rows, kL / G rows per vector: G vectors
  // hold the kL rows [n, n + kL) (elements past row n + nr are not read),
  // one product each with the token's inputs repeated per row (xr), and
  // V::SumGroups sums each row's G lanes into its output lane.
  template <int G>
  static F RowsGroupTile(const TW* wa, int64_t k, int64_t n, int nr,
                         const PV& xr) {
    constexpr int64_t kElems = LoadElems();
    const TW* tile = wa + n * k;
    const int64_t valid = nr * k;
    F acc[G];
    for (int q = 0; q < G; ++q) {
      const int64_t left = valid - q * kElems;
      const PV w =
          left >= kElems
              ? LoadW(tile + q * kElems)
              : LoadWPartial(tile + q * kElems,
                             static_cast<int>(std::max<int64_t>(0, left)));
      acc[q] = MulAdd(V::Zero(), xr, w);
    }
    return V::template SumGroups<G>(acc);
  }

  // The rows tiles over columns [n0, n1) for `count` <= kRowsMaxTokens
  // tokens (inputs xc): each tile of weight rows, read once from memory,
  // serves every token from L1.
  static void RunRows(const LoraArgs& a, const TW* wa, const PackT* xc,
                      int64_t rows, const int64_t* tok, int64_t count,
                      int64_t n0, int64_t n1, int group_lanes) {
    TO* out = static_cast<TO*>(a.out);
    // kG: grouped tiles of kG lanes per row; else kK > 0: whole tiles of
    // contiguous kK-element rows through RowsTileFixed.
    auto sweep = [&](auto lanes, auto fixed_k) {
      constexpr int kG = decltype(lanes)::value;
      constexpr int kK = decltype(fixed_k)::value;
      // The inputs repeated once per row of a vector (grouped tiles only).
      PV xr[kRowsMaxTokens];
      if constexpr (kG > 0) {
        for (int64_t i = 0; i < count; ++i)
          xr[i] = V::template Repeat<kG>(xc + i * rows);
      }
      for (int64_t n = n0; n < n1; n += kL) {
        const int nr = static_cast<int>(std::min<int64_t>(kL, n1 - n));
        for (int64_t i = 0; i < count; ++i) {
          F r;
          if constexpr (kG > 0) {
            r = RowsGroupTile<kG>(wa, a.k, n, nr, xr[i]);
          } else if constexpr (kK > 0) {
            r = nr == kL ? RowsTileFixed<kK>(wa + n * kK, xc + i * rows)
                         : RowsTile(a, wa, xc + i * rows, n, nr);
          } else {
            r = RowsTile(a, wa, xc + i * rows, n, nr);
          }
          StoreVec(a, out + tok[i] * a.out_row_stride + n, r, nr);
        }
      }
    };
    using std::integral_constant;
    using kNone = integral_constant<int, 0>;
    if constexpr (V::kRowGroups) {
      if (group_lanes == 4) return sweep(integral_constant<int, 4>{}, kNone{});
      if (group_lanes == 8) return sweep(integral_constant<int, 8>{}, kNone{});
    }
    if (a.w_row_stride == a.k) {
      switch (a.k) {
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

  // Per work item: convert its tokens' inputs, pack all of its columns
  // (one kNT-column block after another, rows * kNT entries each), then
  // sweep each token tile along the columns, so every output row is written
  // front to back (output traffic dominates a large expand).
  static void RunPack(const LoraArgs& a, const WorkItem* items, int64_t begin,
                      int64_t end) {
    const int64_t rows = kPairs ? (a.k + 1) / 2 : a.k;
    std::unique_ptr<PackT[]> xc, packed;
    int64_t xc_tokens = 0, packed_blocks = 0;
    const TW* w = static_cast<const TW*>(a.w);
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const Group& g = a.groups[item.group];
      const int64_t* tok = a.tokens + g.token_begin + item.m0;
      const int64_t count = item.m1 - item.m0;
      const int64_t blocks = (item.n1 - item.n0 + kNT - 1) / kNT;
      if (count > xc_tokens) {
        xc.reset(new PackT[count * rows]);
        xc_tokens = count;
      }
      ConvertInputs(a, tok, count, xc.get());
      const TW* wa = w + g.adapter * a.w_adapter_stride;
      const int group_lanes = RowGroupLanes(a);
      if (count <= RowsMaxTokens(a.k, group_lanes > 0)) {
        RunRows(a, wa, xc.get(), rows, tok, count, item.n0, item.n1,
                group_lanes);
        continue;
      }
      if (blocks > packed_blocks) {
        packed.reset(new PackT[blocks * rows * kNT]);
        packed_blocks = blocks;
      }
      auto block_cols = [&](int64_t b) {
        return static_cast<int>(
            std::min<int64_t>(kNT, item.n1 - item.n0 - b * kNT));
      };
      for (int64_t b = 0; b < blocks; ++b) {
        Pack(wa + (item.n0 + b * kNT) * a.w_row_stride, a.w_row_stride, a.k,
             block_cols(b), packed.get() + b * rows * kNT);
      }
      auto sweep = [&](auto tile_m, int64_t m) {
        constexpr int kMT = decltype(tile_m)::value;
        for (int64_t b = 0; b < blocks; ++b) {
          const int nc = block_cols(b);
          const PackT* block = packed.get() + b * rows * kNT;
          const int64_t n = item.n0 + b * kNT;
          if (nc == kNT) {
            PackTile<kMT, true>(a, block, xc.get() + m * rows, rows, tok + m, n,
                                nc);
          } else {
            PackTile<kMT, false>(a, block, xc.get() + m * rows, rows, tok + m,
                                 n, nc);
          }
        }
      };
      int64_t m = 0;
      for (; m + kTM <= count; m += kTM)
        sweep(std::integral_constant<int, kTM>{}, m);
      if constexpr (kTM > 2) {
        for (; m + 2 <= count; m += 2)
          sweep(std::integral_constant<int, 2>{}, m);
      }
      for (; m < count; ++m) sweep(std::integral_constant<int, 1>{}, m);
    }
  }
};

template <class V>
void RunDot(const LoraArgs& a, const WorkItem* items, int64_t begin,
            int64_t end) {
  WithTypes(a, [&](auto tx, auto tw, auto to) {
    LoraKernel<V, decltype(tx), decltype(tw), decltype(to)>::RunDot(a, items,
                                                                    begin, end);
  });
}

template <class V>
void RunPack(const LoraArgs& a, const WorkItem* items, int64_t begin,
             int64_t end) {
  WithTypes(a, [&](auto tx, auto tw, auto to) {
    LoraKernel<V, decltype(tx), decltype(tw), decltype(to)>::RunPack(
        a, items, begin, end);
  });
}

template <class V>
IsaKernels MakeKernels() {
  return IsaKernels{&RunDot<V>, &RunPack<V>, V::kTileM};
}
