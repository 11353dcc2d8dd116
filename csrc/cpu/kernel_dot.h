// The "dot" strategy (LoRA shrink: long k, few outputs): register tiles of
// tokens x weight rows, dot products along k, one horizontal sum per output;
// large groups take the pack tiles (ShrinkPacks, ExpandPacks).
// Compiled once per ISA, inside its namespace (kernel_isa_namespace.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernel_common.h"
#include "kernel_interface.h"
#include "kernel_isa_namespace.h"
#include "kernel_pack.h"
#include "tuning.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

template <class V, class TX, class TW, class TO>
struct DotKernel : KernelTypes<V, TX, TW, TO> {
  using Base = KernelTypes<V, TX, TW, TO>;
  static constexpr auto kL = Base::kL;
  static constexpr auto kPairs = Base::kPairs;
  static constexpr auto kTM = Base::kTM;
  static constexpr auto kTN = Base::kTN;
  static constexpr auto kSplit = Base::kSplit;
  using typename Base::F;
  using Pack = PackKernel<V, TX, TW, TO>;

  static void StoreScalar(const LoraArgs& a, TO* o, float v) {
    v *= a.scale;
    if (a.add) v += static_cast<float>(*o);
    *o = static_cast<TO>(v);
  }

  // The next token tile's input rows, prefetched into L2 while a tile runs
  // along k: each pass over the weight rows fetches its share of them, so
  // that they stream at an even rate; from the first pass alone they come
  // too fast for DRAM (#dot-prefetch). Every step, though that asks for
  // each line 2-8 times: once a line, AMD cores ran 1.3-2.6x slower.
  template <int MT>
  struct NextInputs {
    const TX* rows[MT] = {};  // nullptr: no next tile.
    int64_t begin = 0;        // This pass's first element.
    int64_t share_q16 = 0;    // The share of a pass, 16 fractional bits.
  };
  // Prefetches element begin + kk * share of each next row.
  template <int MT>
  static void Prefetch(const NextInputs<MT>& next, int64_t kk) {
    if (next.rows[0] == nullptr) return;
    const int64_t e = next.begin + ((kk * next.share_q16) >> 16);
    for (int i = 0; i < MT; ++i) __builtin_prefetch(next.rows[i] + e, 0, 2);
  }

  // Independent accumulator chains a tile keeps in flight: two FMA pipes of
  // 4-cycle latency need 8. A tile of fewer outputs (rank 1) sums each one
  // into several accumulators, along k in turn (#rank-one-dots).
  static constexpr int kMinChains = 8;

  // res[i][j] = sum_k xr[i][k] * wr[j][k].
  template <int MT, int NR>
  static void DotTile(const TX* const* xr, const TW* const* wr, int64_t k,
                      const NextInputs<MT>& next, float (&res)[MT][NR]) {
    constexpr int kU = std::max(1, kMinChains / (MT * NR));
    F acc[kU][MT][NR];
    for (auto& set : acc)
      for (auto& row : set)
        for (F& v : row) v = V::Zero();
    int64_t kk = 0;
    // step(acc[u], kk) over whole steps of `len` elements, kU steps an
    // iteration; the steps left go to acc[0].
    const auto sweep = [&](int len, const auto& step) {
      for (; kk + kU * len <= k; kk += kU * len) {
        for (int u = 0; u < kU; ++u) {
          Prefetch(next, kk + u * len);
          step(acc[u], kk + u * len);
        }
      }
      if constexpr (kU > 1) {
        for (; kk + len <= k; kk += len) {
          Prefetch(next, kk);
          step(acc[0], kk);
        }
      }
    };
    if constexpr (kPairs) {
      sweep(V::kPairLanes, [&](F(&ac)[MT][NR], int64_t at) {
        typename V::BH xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = V::LoadPairs(xr[i] + at);
        for (int j = 0; j < NR; ++j) {
          const typename V::BH wv = V::LoadPairs(wr[j] + at);
          for (int i = 0; i < MT; ++i) ac[i][j] = V::Dot(ac[i][j], xv[i], wv);
        }
      });
      if (kk < k) {
        const int n = static_cast<int>(k - kk);
        typename V::BH xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = V::LoadPairsPartial(xr[i] + kk, n);
        for (int j = 0; j < NR; ++j) {
          const typename V::BH wv = V::LoadPairsPartial(wr[j] + kk, n);
          for (int i = 0; i < MT; ++i)
            acc[0][i][j] = V::Dot(acc[0][i][j], xv[i], wv);
        }
      }
    } else {
      if constexpr (kSplit) {
        sweep(Base::kSplitElems, [&](F(&ac)[MT][NR], int64_t at) {
          typename V::Split xv[MT];
          for (int i = 0; i < MT; ++i) xv[i] = V::LoadSplit(xr[i] + at);
          for (int j = 0; j < NR; ++j) {
            const typename V::Split wv = V::LoadSplit(wr[j] + at);
            for (int i = 0; i < MT; ++i)
              ac[i][j] = V::FmaSplit(xv[i], wv, ac[i][j]);
          }
        });
      }
      sweep(kL, [&](F(&ac)[MT][NR], int64_t at) {
        F xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = V::Load(xr[i] + at);
        for (int j = 0; j < NR; ++j) {
          const F wv = V::Load(wr[j] + at);
          for (int i = 0; i < MT; ++i) ac[i][j] = V::Fma(xv[i], wv, ac[i][j]);
        }
      });
      if (kk < k) {
        const int n = static_cast<int>(k - kk);
        F xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = V::LoadPartial(xr[i] + kk, n);
        for (int j = 0; j < NR; ++j) {
          const F wv = V::LoadPartial(wr[j] + kk, n);
          for (int i = 0; i < MT; ++i)
            acc[0][i][j] = V::Fma(xv[i], wv, acc[0][i][j]);
        }
      }
    }
    for (int u = 1; u < kU; ++u)
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NR; ++j)
          acc[0][i][j] = V::Add(acc[0][i][j], acc[u][i][j]);
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NR; ++j) res[i][j] = V::Reduce(acc[0][i][j]);
  }

  // Tokens tok[0..MT) against weight rows [n0, n1) of one adapter; the
  // inputs of tokens next_tok[0..MT) (if not nullptr) are prefetched
  // meanwhile.
  template <int MT, int NR>
  static void DotBlock(const LoraArgs& a, const TW* wa, const int64_t* tok,
                       int64_t n0, int64_t n1,
                       const int64_t* next_tok = nullptr) {
    const TX* x = static_cast<const TX*>(a.x);
    TO* out = static_cast<TO*>(a.out);
    const TX* xr[MT];
    for (int i = 0; i < MT; ++i) xr[i] = x + tok[i] * a.x_row_stride;
    NextInputs<MT> next;
    if (next_tok != nullptr) {
      for (int i = 0; i < MT; ++i)
        next.rows[i] = x + next_tok[i] * a.x_row_stride;
    }
    const int64_t passes = (n1 - n0 + NR - 1) / NR;
    next.share_q16 = (int64_t{1} << 16) / passes;
    for (int64_t n = n0; n < n1; n += NR) {
      next.begin = (n - n0) / NR * a.k / passes;
      const int nr = static_cast<int>(std::min<int64_t>(NR, n1 - n));
      // Rows past the end repeat the last valid one; their sums are dropped.
      const TW* wr[NR];
      for (int j = 0; j < NR; ++j)
        wr[j] = wa + (n + std::min(j, nr - 1)) * a.w_row_stride;
      float res[MT][NR];
      DotTile<MT, NR>(xr, wr, a.k, next, res);
      for (int i = 0; i < MT; ++i) {
        TO* o = out + tok[i] * a.out_row_stride + n;
        for (int j = 0; j < nr; ++j) StoreScalar(a, o + j, res[i][j]);
      }
    }
  }

  // Whether an item goes to the pack tiles (ShrinkPacks, ExpandPacks).
  static bool Packs(const LoraArgs& a, const WorkItem& item) {
    const int64_t tokens = a.groups[item.group].token_count;
    const int64_t outputs = item.n1 - item.n0;
    return (kPairs ? ShrinkPacks(tokens, outputs)
                   : ShrinkPacksFma(tokens, outputs, kL)) ||
           ExpandPacks(tokens, a.k, outputs);
  }

  // Items of a group are consecutive: each run of items for the pack tiles
  // goes to them at once, so its weights are packed once.
  static void Run(const LoraArgs& a, const WorkItem* items, int64_t begin,
                  int64_t end) {
    for (int64_t it = begin; it < end;) {
      const bool packs = Packs(a, items[it]);
      int64_t run_end = it + 1;
      while (run_end < end && Packs(a, items[run_end]) == packs) ++run_end;
      if (packs) {
        Pack::Run(a, items, it, run_end);
      } else {
        RunDots(a, items, it, run_end);
      }
      it = run_end;
    }
  }

  static void RunDots(const LoraArgs& a, const WorkItem* items, int64_t begin,
                      int64_t end) {
    const TW* w = static_cast<const TW*>(a.w);
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const Group& g = a.groups[item.group];
      const int64_t* tok = a.tokens + g.token_begin;
      const TW* wa = w + g.adapter * a.w_adapter_stride;
      // One weight row (rank 1, vLLM's only rank below a tile's rows) takes
      // one-row tiles, which the others would fill with copies of it. Two
      // tokens share each weight load (adapters with 2-3 tokens are common
      // in decode batches), over as many accumulators as the tile has.
      if (item.n1 - item.n0 == 1) {
        RunTiles<1, 1, 1>(a, wa, tok, item);
      } else {
        RunTiles<kTN, kTM / 2 * kTN, 2 * kTN>(a, wa, tok, item);
      }
    }
  }

  // The item's tokens in tiles of kTM, 2 and 1 tokens by NR, NR2 and NR1
  // weight rows. Out of line: inlined together, the one-row tiles cost the
  // others registers (AVX2's 1 x 8 tile spilled its input).
  template <int NR, int NR2, int NR1>
  [[gnu::noinline]] static void RunTiles(const LoraArgs& a, const TW* wa,
                                         const int64_t* tok,
                                         const WorkItem& item) {
    int64_t m = item.m0;
    for (; m + kTM <= item.m1; m += kTM) {
      const bool next = m + 2 * kTM <= item.m1;
      DotBlock<kTM, NR>(a, wa, tok + m, item.n0, item.n1,
                        next ? tok + m + kTM : nullptr);
    }
    if constexpr (kTM > 2) {
      for (; m + 2 <= item.m1; m += 2)
        DotBlock<2, NR2>(a, wa, tok + m, item.n0, item.n1);
    }
    for (; m < item.m1; ++m) DotBlock<1, NR1>(a, wa, tok + m, item.n0, item.n1);
  }
};

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
