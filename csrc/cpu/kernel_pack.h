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

  // out rows tok[0..MT), columns [n, n + nc): the packed block P times the
  // converted inputs xc (rows entries per token, x_stride apart). kFull:
  // nc == kNT, known at compile time so the accumulators stay in registers.
  template <int MT, bool kFull>
  static void PackTile(const LoraArgs& a, const PackT* P, const PackT* xc,
                       int64_t x_stride, int64_t rows, const int64_t* tok,
                       int64_t n, int nc) {
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
          const typename V::BH xb = V::BroadcastPair(xc[i * x_stride + j]);
          for (int v = 0; v < kNV; ++v)
            if (v < nv) acc[i][v] = V::Dot(acc[i][v], xb, wv[v]);
        }
      } else {
        F wv[kNV];
        for (int v = 0; v < kNV; ++v)
          if (v < nv) wv[v] = V::Load(pj + v * kL);
        for (int i = 0; i < MT; ++i) {
          const F xb = V::Set1(xc[i * x_stride + j]);
          for (int v = 0; v < kNV; ++v)
            if (v < nv) acc[i][v] = V::Fma(xb, wv[v], acc[i][v]);
        }
      }
    }
    // Unrolled: acc indexed by a variable would live in memory, stored
    // to on every step of the loop above.
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      StoreRow(a, out + tok[i] * a.out_row_stride + n, acc[i], nc);
    }
  }

  // o[0..nc) = scale * acc (+ o), nc <= kNT.
  static void StoreRow(const LoraArgs& a, TO* o, const F (&acc)[kNV], int nc) {
    for (int v = 0; v < kNV && v * kL < nc; ++v) {
      StoreVec(a, o + v * kL, acc[v], nc - v * kL);
    }
  }

  // Per work item: convert its tokens' inputs (unless x holds them already
  // as consecutive rows, read in place: a copy of a long shrink's rows took
  // L2 from the packed weights, #shrink-packs), pack all of its columns (one
  // kNT-column block after another, rows * kNT entries each; kept for the
  // next item of the same columns), then sweep each token tile along the
  // columns, so every output row is written front to back (output traffic
  // dominates a large expand).
  static void Run(const LoraArgs& a, const WorkItem* items, int64_t begin,
                  int64_t end) {
    const int64_t rows = kPairs ? (a.k + 1) / 2 : a.k;
    std::unique_ptr<PackT[]> xc;
    int64_t xc_tokens = 0;
    PackedBlocks<PackT> packed;
    const TW* w = static_cast<const TW*>(a.w);
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const Group& g = a.groups[item.group];
      const int64_t* tok = a.tokens + g.token_begin + item.m0;
      const int64_t count = item.m1 - item.m0;
      const TW* wa = w + g.adapter * a.w_adapter_stride;
      if (a.k == 1 && a.w_row_stride == 1) {
        int64_t m = 0;
        for (; m + kTM <= count; m += kTM)
          RankOneTile<kTM>(a, wa, tok + m, item.n0, item.n1);
        for (; m < count; ++m) RankOneTile<1>(a, wa, tok + m, item.n0, item.n1);
        continue;
      }
      const int64_t blocks = (item.n1 - item.n0 + kNT - 1) / kNT;
      if (count > xc_tokens) {
        xc.reset(new PackT[count * rows]);
        xc_tokens = count;
      }
      const int group_lanes = Rows::RowGroupLanes(a);
      // The rows rules are an expand's (a.k a rank); large shrink groups
      // come here for packing.
      if (a.k <= kMaxPackK &&
          count <= V::RowsMaxTokens(a.k, group_lanes > 0, Base::kProducts)) {
        ConvertInputs(a, tok, count, xc.get());
        Rows::Run(a, wa, xc.get(), rows, tok, count, item.n0, item.n1,
                  group_lanes);
        continue;
      }
      const PackT* xs = xc.get();
      int64_t x_stride = rows;
      if (Base::PairsInPlace(a, tok, count)) {
        xs = static_cast<const PackT*>(a.x) + tok[0] * a.x_row_stride / 2;
        x_stride = a.x_row_stride / 2;
      } else {
        ConvertInputs(a, tok, count, xc.get());
      }
      auto block_cols = [&](int64_t b) {
        return static_cast<int>(
            std::min<int64_t>(kNT, item.n1 - item.n0 - b * kNT));
      };
      if (packed.NeedsPacking(wa, item.n0, item.n1, blocks * rows * kNT)) {
        for (int64_t b = 0; b < blocks; ++b) {
          Pack(wa + (item.n0 + b * kNT) * a.w_row_stride, a.w_row_stride, a.k,
               block_cols(b), packed.data() + b * rows * kNT);
        }
      }
      auto sweep = [&](auto tile_m, int64_t m) {
        constexpr int kMT = decltype(tile_m)::value;
        for (int64_t b = 0; b < blocks; ++b) {
          const int nc = block_cols(b);
          const PackT* block = packed.data() + b * rows * kNT;
          const int64_t n = item.n0 + b * kNT;
          if (nc == kNT) {
            PackTile<kMT, true>(a, block, xs + m * x_stride, x_stride, rows,
                                tok + m, n, nc);
          } else {
            PackTile<kMT, false>(a, block, xs + m * x_stride, x_stride, rows,
                                 tok + m, n, nc);
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

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
