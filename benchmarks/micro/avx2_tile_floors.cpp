// The floors of the avx2 path's tiles outside the library (docs/tuning.md
// #avx2-tile-floors): the rows tile of a one-token rank-16 expand (bf16
// weights in vLLM's [N, r] layout, weights hot in L2), the same expand on
// weights kept transposed across calls, and the dot tile of a prefill shrink,
// each with the alternatives measured against it. Uses the
// kernels' own vector policy (csrc/cpu/vec_avx2.h) and dot tile. Build and run
// on an AVX2 CPU with the lines in docs/tuning.md#avx2-tile-floors.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#define VLLM_CPU_LORA_ISA_NS avx2
#include "kernel_dot.h"
#include "vec_avx2.h"

namespace {

using vllm_cpu_lora::avx2::VecAvx2;
using V = VecAvx2;
using F = __m256;
using Bf16 = c10::BFloat16;

// Best of 7 timings of `reps` calls, in seconds per call.
template <class Fn>
double BestSeconds(Fn fn, int reps) {
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) fn();
    const std::chrono::duration<double> d =
        std::chrono::steady_clock::now() - t0;
    best = std::min(best, d.count() / reps);
  }
  return best;
}

// Normal values in every element of v.
template <class T>
void Fill(std::vector<T>& v, std::mt19937& gen) {
  std::normal_distribution<float> dist;
  for (T& e : v) e = static_cast<T>(dist(gen));
}

// The expands' output step, the same in every loop below: *o (8 bf16) +=
// scale * sums, rounded.
void StoreScaledAdd(Bf16* o, F sums, F scale) {
  V::Store(o, V::Add(V::Mul(sums, scale), V::Load(o)));
}

// ---- one-token expand, rank 16: out[n] += scale * sum_k x[k] w[n][k] ----
constexpr int kRank = 16;

// The rows tile's work (kernel_rows.h) on U tiles of 8 rows per step, with
// the input split hoisted out of the loop, which the library's tile redoes
// per tile: the layout's floor, not the library's; bf16 output with add.
template <int U>
__attribute__((noinline)) void ExpandTiles(const Bf16* w, const float* x,
                                           Bf16* out, int n_out, float scale) {
  const V::Split xs = V::LoadSplit(x);
  const F s = V::Set1(scale);
  for (int n = 0; n < n_out; n += 8 * U) {
    F r[U];
    for (int u = 0; u < U; ++u) {
      F acc[8];
      for (int j = 0; j < 8; ++j)
        acc[j] = V::FmaSplit(xs, V::LoadSplit(w + (n + 8 * u + j) * kRank),
                             V::Zero());
      r[u] = V::SumLanes(acc);
    }
    for (int u = 0; u < U; ++u) StoreScaledAdd(out + n + 8 * u, r[u], s);
  }
}

// The products and sums only: fp32 sums stored, no output conversion.
__attribute__((noinline)) void ExpandSumsOnly(const Bf16* w, const float* x,
                                              float* out, int n_out) {
  const V::Split xs = V::LoadSplit(x);
  for (int n = 0; n < n_out; n += 8) {
    F acc[8];
    for (int j = 0; j < 8; ++j)
      acc[j] = V::FmaSplit(xs, V::LoadSplit(w + (n + j) * kRank), V::Zero());
    _mm256_storeu_ps(out + n, V::SumLanes(acc));
  }
}

// The route not built: weights kept across calls in blocks of 8 columns, each
// column's bf16 pairs (ranks 2i, 2i+1) side by side ([N / 8][K / 2][8][2]).
// One load and its split give two ranks of 8 columns: no sums across lanes.
// U blocks a step; bf16 output with add.
template <int K, int U>
__attribute__((noinline)) void ExpandPairBlocks(const Bf16* w, const float* x,
                                                Bf16* out, int n_out,
                                                float scale) {
  F xe[K / 2], xo[K / 2];
  for (int i = 0; i < K / 2; ++i) {
    xe[i] = V::Set1(x[2 * i]);
    xo[i] = V::Set1(x[2 * i + 1]);
  }
  const F s = V::Set1(scale);
  for (int n = 0; n < n_out; n += 8 * U) {
    F even[U], odd[U];
    for (int u = 0; u < U; ++u) even[u] = odd[u] = V::Zero();
    for (int i = 0; i < K / 2; ++i) {
      for (int u = 0; u < U; ++u) {
        const Bf16* block = w + ((n / 8 + u) * (K / 2) + i) * 16;
        const V::Split p = V::SplitBf16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
        even[u] = V::Fma(p.even, xe[i], even[u]);
        odd[u] = V::Fma(p.odd, xo[i], odd[u]);
      }
    }
    for (int u = 0; u < U; ++u)
      StoreScaledAdd(out + n + 8 * u, V::Add(even[u], odd[u]), s);
  }
}

// The bf16 output alone: widen, scale, add, round, store; no products.
__attribute__((noinline)) void ExpandOutputOnly(const float* sums, Bf16* out,
                                                int n_out, float scale) {
  const F s = V::Set1(scale);
  for (int n = 0; n < n_out; n += 8)
    StoreScaledAdd(out + n, V::Load(sums + n), s);
}

// [N][K] weights as ExpandPairBlocks reads them.
template <int K>
std::vector<Bf16> PairBlocks(const std::vector<Bf16>& w, int n_out) {
  std::vector<Bf16> blocks(w.size());
  for (int n = 0; n < n_out; ++n)
    for (int k = 0; k < K; ++k)
      blocks[((n / 8) * (K / 2) + k / 2) * 16 + (n % 8) * 2 + k % 2] =
          w[n * K + k];
  return blocks;
}

// ns per 8 outputs of the pair blocks (1, 2, 4 a step) and of the output
// alone, rank K, bf16 output with add.
template <int K>
void PrintPairBlocks(int n_out, std::mt19937& gen) {
  std::vector<Bf16> w(n_out * K), out(n_out);
  std::vector<float> x(K), sums(n_out);
  Fill(w, gen);
  Fill(out, gen);
  Fill(x, gen);
  Fill(sums, gen);
  const std::vector<Bf16> blocks = PairBlocks<K>(w, n_out);
  const double tiles = n_out / 8.0;
  auto ns = [&](auto fn) { return BestSeconds(fn, 2000) * 1e9 / tiles; };
  auto pairs = [&](auto u) {
    return ns([&] {
      ExpandPairBlocks<K, decltype(u)::value>(blocks.data(), x.data(),
                                              out.data(), n_out, 0.5f);
    });
  };
  std::printf(
      "expand T=1 r=%d N=%d on pair blocks, ns per 8 outputs: 1 block/step "
      "%.2f, 2 %.2f, 4 %.2f; the output alone %.2f\n",
      K, n_out, pairs(std::integral_constant<int, 1>{}),
      pairs(std::integral_constant<int, 2>{}),
      pairs(std::integral_constant<int, 4>{}),
      ns([&] { ExpandOutputOnly(sums.data(), out.data(), n_out, 0.5f); }));
}

// ---- prefill shrink: out[t][n] = sum_k x[t][k] w[n][k], bf16 ----
constexpr int kHidden = 4096;

// The library's dot tile (kernel_dot.h): 2 tokens x 4 rows, both operands
// split.
using Dot = vllm_cpu_lora::avx2::DotKernel<V, Bf16, Bf16, float>;

__attribute__((noinline)) void ShrinkSplit2x4(const Bf16* x, const Bf16* w,
                                              int tokens, int rank,
                                              float* out) {
  for (int t = 0; t + 2 <= tokens; t += 2) {
    const Bf16* xr[2] = {x + t * kHidden, x + (t + 1) * kHidden};
    for (int n = 0; n < rank; n += 4) {
      const Bf16* wr[4];
      for (int j = 0; j < 4; ++j) wr[j] = w + (n + j) * kHidden;
      float res[2][4];
      Dot::DotTile<2, 4>(xr, wr, kHidden, Dot::NextInputs<2>{}, res);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) out[(t + i) * rank + n + j] = res[i][j];
    }
  }
}

// The alternative: MT tokens' inputs converted to fp32 per k block of KC,
// MT x NR tiles of widened weights, one FMA chain per accumulator.
template <int MT, int NR, int KC>
__attribute__((noinline)) void ShrinkConverted(const Bf16* x, const Bf16* w,
                                               int tokens, int rank,
                                               float* out) {
  alignas(32) float xc[MT * KC];
  for (int t = 0; t + MT <= tokens; t += MT) {
    float res[MT][64] = {};
    for (int k0 = 0; k0 < kHidden; k0 += KC) {
      for (int i = 0; i < MT; ++i)
        for (int k = 0; k < KC; k += 8)
          _mm256_store_ps(xc + i * KC + k,
                          V::Load(x + (t + i) * kHidden + k0 + k));
      for (int n = 0; n < rank; n += NR) {
        F acc[MT][NR];
        for (auto& row : acc)
          for (F& v : row) v = V::Zero();
        for (int k = 0; k < KC; k += 8) {
          for (int j = 0; j < NR; ++j) {
            const F wv = V::Load(w + (n + j) * kHidden + k0 + k);
            for (int i = 0; i < MT; ++i)
              acc[i][j] =
                  V::Fma(_mm256_load_ps(xc + i * KC + k), wv, acc[i][j]);
          }
        }
        for (int i = 0; i < MT; ++i)
          for (int j = 0; j < NR; ++j) res[i][n + j] += V::Reduce(acc[i][j]);
      }
    }
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < rank; ++j) out[(t + i) * rank + j] = res[i][j];
  }
}

}  // namespace

int main() {
  std::mt19937 gen(0);
  for (int n_out : {4096, 11008}) {
    std::vector<Bf16> w(n_out * kRank), out(n_out);
    std::vector<float> x(kRank), sums(n_out);
    Fill(w, gen);
    Fill(x, gen);
    Fill(out, gen);
    const double tiles = n_out / 8.0;
    auto ns = [&](auto fn) { return BestSeconds(fn, 2000) * 1e9 / tiles; };
    std::printf(
        "expand T=1 r=16 N=%d, ns per 8 outputs: 1 tile/step %.2f, "
        "2 tiles/step %.2f, sums only %.2f\n",
        n_out, ns([&] {
          ExpandTiles<1>(w.data(), x.data(), out.data(), n_out, 0.5f);
        }),
        ns([&] {
          ExpandTiles<2>(w.data(), x.data(), out.data(), n_out, 0.5f);
        }),
        ns([&] { ExpandSumsOnly(w.data(), x.data(), sums.data(), n_out); }));
    PrintPairBlocks<16>(n_out, gen);
    PrintPairBlocks<8>(n_out, gen);
  }
  for (int tokens : {504, 2046}) {  // Inputs in L3; streamed from DRAM.
    for (int rank : {8, 16, 64}) {
      std::vector<Bf16> x(tokens * kHidden), w(rank * kHidden);
      std::vector<float> out(tokens * rank);
      Fill(x, gen);
      Fill(w, gen);
      const double flop = 2.0 * tokens * kHidden * rank;
      auto gflops = [&](auto fn) { return flop / BestSeconds(fn, 3) / 1e9; };
      std::printf(
          "shrink T=%d r=%d, GFLOP/s: split 2x4 %.1f, converted 3x4 %.1f, "
          "4x2 %.1f, 6x2 %.1f\n",
          tokens, rank, gflops([&] {
            ShrinkSplit2x4(x.data(), w.data(), tokens, rank, out.data());
          }),
          gflops([&] {
            ShrinkConverted<3, 4, 512>(x.data(), w.data(), tokens, rank,
                                       out.data());
          }),
          gflops([&] {
            ShrinkConverted<4, 2, 512>(x.data(), w.data(), tokens, rank,
                                       out.data());
          }),
          gflops([&] {
            ShrinkConverted<6, 2, 512>(x.data(), w.data(), tokens, rank,
                                       out.data());
          }));
    }
  }
}
