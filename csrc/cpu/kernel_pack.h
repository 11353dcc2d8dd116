// The "pack" strategy (LoRA expand: short k, many outputs): a block of
// weight rows repacked so that output columns are the vector lanes, swept by
// register tiles of tokens; groups of a few tokens take the rows strategy.
// Compiled once per ISA, inside its namespace (kernel_isa_namespace.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "kernel_common.h"
#include "kernel_interface.h"
#include "kernel_isa_namespace.h"
#include "kernel_rows.h"
#include "tuning.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

template <class V, class TX, class TW, class TO>
struct PackKernel : KernelTypes<V, TX, TW, TO> {
  using Base = KernelTypes<V, TX, TW, TO>;
  using Base::ConvertInputs;
  static constexpr auto kL = Base::kL;
  static constexpr auto kPairs = Base::kPairs;
  static constexpr int kTM = V::kPackTileM;  // Tokens per pack tile.
  using Base::StoreVec;
  using typename Base::F;
  using typename Base::PackT;
  using Rows = RowsKernel<V, TX, TW, TO>;
  static constexpr int kNV = V::kPackVectors;  // Vectors per tile row.
  static constexpr int kNT = kNV * kL;         // Output columns per pack tile.

  // Entries per row of a packed block of nc columns: whole vectors.
  static constexpr int BlockWidth(int nc) { return (nc + kL - 1) / kL * kL; }

  // P[j * stride + c] = w[c][j] for c < nc (bf16 pairs: w[c][2j],
  // w[c][2j+1]), zero for nc <= c < BlockWidth(nc) <= stride; later columns
  // are never read.
  static void Pack(const TW* w, int64_t row_stride, int64_t k, int nc,
                   int stride, PackT* P) {
    const int64_t rows = kPairs ? (k + 1) / 2 : k;
    int c0 = 0;
    if constexpr (V::kGather) {
      c0 = V::template PackColumns<TW, kPairs>(w, row_stride, k, nc, stride, P);
    }
    const int filled = BlockWidth(nc);
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
        P[j * stride + c] = v;
      }
    }
  }

  // Whether RankOneTile takes bf16 weights and output as even and odd halves.
  static constexpr bool kSplitStores = V::kSplitBf16 &&
                                       std::is_same_v<TW, c10::BFloat16> &&
                                       std::is_same_v<TO, c10::BFloat16>;

  // Rank 1 in contiguous rows (vLLM's smallest max_lora_rank): an output is
  // one input times one weight, so tokens tok[0..MT) read the weights of
  // columns [n0, n1) in place, a vector at a time, with nothing packed
  // (#rank-one-tile).
  template <int MT>
  static void RankOneTile(const LoraArgs& a, const TW* w, const int64_t* tok,
                          int64_t n0, int64_t n1) {
    const TX* x = static_cast<const TX*>(a.x);
    TO* out = static_cast<TO*>(a.out);
    F xb[MT];
    TO* o[MT];
    for (int i = 0; i < MT; ++i) {
      xb[i] = V::Set1(static_cast<float>(x[tok[i] * a.x_row_stride]));
      o[i] = out + tok[i] * a.out_row_stride;
    }
    int64_t n = n0;
    if constexpr (kSplitStores) {
      // bf16 weights and output as even and odd halves (LoadSplit,
      // StoreSplit): a shift or a mask per vector instead of widening 16 at
      // a time, and one store step per 32 outputs instead of narrowing two
      // vectors; the scale goes into the inputs and the add into an FMA
      // (#rank-one-split).
      F xs[MT];
      for (int i = 0; i < MT; ++i) xs[i] = V::Mul(xb[i], V::Set1(a.scale));
      for (; n + 2 * kL <= n1; n += 2 * kL) {
        const typename V::Split wv = V::LoadSplit(w + n);
        for (int i = 0; i < MT; ++i) {
          typename V::Split r;
          if (a.add) {
            const typename V::Split old = V::LoadSplit(o[i] + n);
            r = {V::Fma(xs[i], wv.even, old.even),
                 V::Fma(xs[i], wv.odd, old.odd)};
          } else {
            r = {V::Mul(xs[i], wv.even), V::Mul(xs[i], wv.odd)};
          }
          V::StoreSplit(o[i] + n, r);
        }
      }
    }
    for (; n + kNT <= n1; n += kNT) {
      F wv[kNV];
      for (int v = 0; v < kNV; ++v) wv[v] = V::Load(w + n + v * kL);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        for (int v = 0; v < kNV; ++v)
          StoreVec(a, o[i] + n + v * kL, V::Mul(xb[i], wv[v]), kL);
      }
    }
    for (; n + kL <= n1; n += kL) {
      const F wv = V::Load(w + n);
      for (int i = 0; i < MT; ++i) StoreVec(a, o[i] + n, V::Mul(xb[i], wv), kL);
    }
    if (n < n1) {
      const int nc = static_cast<int>(n1 - n);
      const F wv = V::LoadPartial(w + n, nc);
      for (int i = 0; i < MT; ++i) StoreVec(a, o[i] + n, V::Mul(xb[i], wv), nc);
    }
  }

  // out rows tok[0..MT), columns [n, n + nc), nc <= NV * kL: the packed
  // block P (NV * kL entries a row) times the converted inputs xc, token i's
  // entry j at xc[i * x_stride + j]; or (kConvert, fp32 products only) times
  // the inputs in x, converted kL entries of each token at a time into a
  // buffer that the tile reads from one pointer (a tall tile would hold a
  // pointer per token; #shrink-packs-fma).
  template <int MT, int NV, bool kConvert = false>
  static void PackTile(const LoraArgs& a, const PackT* P, const PackT* xc,
                       int64_t x_stride, int64_t rows, const int64_t* tok,
                       int64_t n, int nc) {
    TO* out = static_cast<TO*>(a.out);
    F acc[MT][NV];
    for (int i = 0; i < MT; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = V::Zero();
    // The products of P's row j with the inputs xj[i * token_stride].
    auto step = [&](int64_t j, const PackT* xj, int64_t token_stride) {
      const PackT* pj = P + j * NV * kL;
      if constexpr (kPairs) {
        typename V::BH wv[NV];
        for (int v = 0; v < NV; ++v) wv[v] = V::LoadPacked(pj + v * kL);
#pragma GCC unroll 16
        for (int i = 0; i < MT; ++i) {
          const typename V::BH xb = V::BroadcastPair(xj[i * token_stride]);
          for (int v = 0; v < NV; ++v) acc[i][v] = V::Dot(acc[i][v], xb, wv[v]);
        }
      } else {
        F wv[NV];
        for (int v = 0; v < NV; ++v) wv[v] = V::Load(pj + v * kL);
#pragma GCC unroll 16
        for (int i = 0; i < MT; ++i) {
          const F xb = V::Set1(xj[i * token_stride]);
          for (int v = 0; v < NV; ++v) acc[i][v] = V::Fma(xb, wv[v], acc[i][v]);
        }
      }
    };
    if constexpr (kConvert) {
      static_assert(!kPairs);
      const TX* x = static_cast<const TX*>(a.x);
      alignas(64) PackT converted[MT * kL];
      for (int64_t j0 = 0; j0 < rows; j0 += kL) {
        const int chunk = static_cast<int>(std::min<int64_t>(kL, rows - j0));
        for (int i = 0; i < MT; ++i) {
          const TX* xr = x + tok[i] * a.x_row_stride + j0;
          V::Store(converted + i * kL,
                   chunk == kL ? V::Load(xr) : V::LoadPartial(xr, chunk));
        }
        for (int jj = 0; jj < chunk; ++jj) step(j0 + jj, converted + jj, kL);
      }
    } else {
      for (int64_t j = 0; j < rows; ++j) step(j, xc + j, x_stride);
    }
    // Unrolled: acc indexed by a variable would live in memory, stored
    // to on every step of the loop above.
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      StoreRow(a, out + tok[i] * a.out_row_stride + n, acc[i], nc);
    }
  }

  // The output columns [n, n + kNT) of tokens tok[0..count), into L1: swept
  // block by block, the rows are read a block at a time, too briefly for the
  // hardware prefetchers (#pack-block-by-block).
  static void PrefetchOutputs(const LoraArgs& a, const int64_t* tok,
                              int64_t count, int64_t n) {
    const TO* out = static_cast<const TO*>(a.out);
    for (int64_t i = 0; i < count; ++i) {
      const char* o =
          reinterpret_cast<const char*>(out + tok[i] * a.out_row_stride + n);
      for (size_t b = 0; b < kNT * sizeof(TO); b += kCacheLineBytes) {
        __builtin_prefetch(o + b, 1, 3);
      }
    }
  }

  // o[0..nc) = scale * acc (+ o), nc <= NV * kL.
  template <int NV>
  static void StoreRow(const LoraArgs& a, TO* o, const F (&acc)[NV], int nc) {
    for (int v = 0; v < NV && v * kL < nc; ++v) {
      StoreVec(a, o + v * kL, acc[v], nc - v * kL);
    }
  }

  // fn(std::integral_constant<int, nv>{}) for nv in [1, kNV].
  template <int NV = kNV, class Fn>
  static void WithVectors(int nv, Fn&& fn) {
    if constexpr (NV > 1) {
      if (nv < NV) return WithVectors<NV - 1>(nv, fn);
    }
    fn(std::integral_constant<int, NV>{});
  }

  // Tiles of tokens tok[0..count) against the only block P of an item,
  // columns [n, n + nc): where it is narrower than kNT (a shrink's ranks)
  // and the products are fp32 FMAs, as many tokens a tile as keep kTM * kNV
  // accumulators busy, up to 16, their inputs converted by the tile
  // (#shrink-packs-fma). Returns the tokens they took, from the front.
  static int64_t TallTiles(const LoraArgs& a, const PackT* P,
                           const int64_t* tok, int64_t count, int64_t n,
                           int nc) {
    int64_t m = 0;
    WithVectors(BlockWidth(nc) / kL, [&](auto vectors) {
      constexpr int kNVec = decltype(vectors)::value;
      constexpr int kTall = kTM * kNV / kNVec;
      static_assert(kTall <= 16, "PackTile unrolls up to 16 tokens");
      if constexpr (!kPairs && kTall > kTM) {
        const int64_t rows = a.k;
        for (; m + kTall <= count; m += kTall) {
          PackTile<kTall, kNVec, true>(a, P, nullptr, 0, rows, tok + m, n, nc);
        }
      }
    });
    return m;
  }

  // Per work item: convert its tokens' inputs (unless x holds them already
  // as consecutive rows, read in place: a copy of a long shrink's rows took
  // L2 from the packed weights, #shrink-packs), pack all of its columns (one
  // kNT-column block after another, rows * kNT entries each; kept for the
  // next item of the same columns), then sweep each token tile along the
  // columns, so every output row is written front to back (output traffic
  // dominates a large expand); an item of one block starts with TallTiles.
  // Or (PackBlockByBlock) pack one block at a time and run every token tile
  // over it before the next.
  static void Run(const LoraArgs& a, const WorkItem* items, int64_t begin,
                  int64_t end) {
    const int64_t rows = kPairs ? (a.k + 1) / 2 : a.k;
    std::unique_ptr<PackT[]> xc;
    int64_t xc_tokens = 0;
    PackedBlocks<PackT> packed;
    PackedBlocks<PackT> block;  // One block, where packed block by block.
    const TW* w = static_cast<const TW*>(a.w);
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const Group& g = a.groups[item.group];
      const int64_t* tok = a.tokens + g.token_begin + item.m0;
      int64_t count = item.m1 - item.m0;
      const TW* wa = w + g.adapter * a.w_adapter_stride;
      if (a.k == 1 && a.w_row_stride == 1) {
        int64_t m = 0;
        for (; m + kTM <= count; m += kTM)
          RankOneTile<kTM>(a, wa, tok + m, item.n0, item.n1);
        for (; m < count; ++m) RankOneTile<1>(a, wa, tok + m, item.n0, item.n1);
        continue;
      }
      const int64_t blocks = (item.n1 - item.n0 + kNT - 1) / kNT;
      // The converted inputs of tokens tok[0..count), in xc.
      auto convert = [&] {
        if (count > xc_tokens) {
          xc.reset(new PackT[count * rows]);
          xc_tokens = count;
        }
        ConvertInputs(a, tok, count, xc.get());
        return xc.get();
      };
      const int group_lanes = Rows::RowGroupLanes(a);
      // The rows rules are an expand's (a.k a rank); large shrink groups
      // come here for packing.
      if (a.k <= kMaxPackK &&
          count <= V::RowsMaxTokens(a.k, group_lanes > 0, Base::kProducts)) {
        Rows::Run(a, wa, convert(), rows, tok, count, item.n0, item.n1,
                  group_lanes);
        continue;
      }
      auto block_cols = [&](int64_t b) {
        return static_cast<int>(
            std::min<int64_t>(kNT, item.n1 - item.n0 - b * kNT));
      };
      auto pack_block = [&](int64_t b, PackT* P) {
        const int nc = block_cols(b);
        Pack(wa + (item.n0 + b * kNT) * a.w_row_stride, a.w_row_stride, a.k, nc,
             BlockWidth(nc), P);
      };
      const bool block_by_block =
          blocks > 1 && PackBlockByBlock(count, rows * kNT * sizeof(PackT),
                                         item.n1 - item.n0 > a.k);
      if (!block_by_block &&
          packed.NeedsPacking(wa, item.n0, item.n1, blocks * rows * kNT)) {
        for (int64_t b = 0; b < blocks; ++b) {
          pack_block(b, packed.data() + b * rows * kNT);
        }
      }
      if (blocks == 1) {
        const int64_t done =
            TallTiles(a, packed.data(), tok, count, item.n0, block_cols(0));
        tok += done;
        count -= done;
        if (count == 0) continue;
      }
      const PackT* xs;
      int64_t x_stride = rows;
      if (Base::PairsInPlace(a, tok, count)) {
        xs = static_cast<const PackT*>(a.x) + tok[0] * a.x_row_stride / 2;
        x_stride = a.x_row_stride / 2;
      } else {
        xs = convert();
      }
      // One pass of every token tile along all blocks, or one pass per block.
      const int64_t passes = block_by_block ? blocks : 1;
      for (int64_t pass = 0; pass < passes; ++pass) {
        // Blocks [b0, b1), block b packed at P + (b - b0) * rows * kNT.
        int64_t b0 = 0, b1 = blocks;
        const PackT* P = packed.data();
        if (block_by_block) {
          b0 = pass;
          b1 = pass + 1;
          if (b1 < blocks) PrefetchOutputs(a, tok, count, item.n0 + b1 * kNT);
          const int64_t n0 = item.n0 + pass * kNT;
          if (block.NeedsPacking(wa, n0, n0 + block_cols(pass), rows * kNT)) {
            pack_block(pass, block.data());
          }
          P = block.data();
        }
        int64_t m = 0;
        auto tiles = [&](auto tile_m) {
          constexpr int kMT = decltype(tile_m)::value;
          for (; m + kMT <= count; m += kMT) {
            for (int64_t b = b0; b < b1; ++b) {
              const int nc = block_cols(b);
              WithVectors(BlockWidth(nc) / kL, [&](auto vectors) {
                PackTile<kMT, vectors>(a, P + (b - b0) * rows * kNT,
                                       xs + m * x_stride, x_stride, rows,
                                       tok + m, item.n0 + b * kNT, nc);
              });
            }
          }
        };
        tiles(std::integral_constant<int, kTM>{});
        if constexpr (kTM > 2) tiles(std::integral_constant<int, 2>{});
        tiles(std::integral_constant<int, 1>{});
      }
    }
  }
};

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
