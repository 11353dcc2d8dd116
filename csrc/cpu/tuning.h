// The tuning thresholds: which blocking, tiles and threading a product gets.
// Each has a one-line reason here; the measurements behind it are in
// docs/tuning.md, under the same name. Included by the dispatcher and by the
// kernel TUs (before their `#pragma GCC target`): plain constants only.
#pragma once

#include <cstdint>

namespace vllm_cpu_lora {

// Token counts no group reaches.
constexpr int64_t kNever = int64_t{1} << 62;

// Products reducing over at most this many elements (expands: k is the
// rank) with more outputs than that take the pack strategy; its rows tiles
// lose to the dot tiles beyond (#max-pack-k).
constexpr int64_t kMaxPackK = 256;

// Shrink groups of at least 128 tokens and 64 ranks take the pack tiles too
// where the products are bf16 pairs: the dot tiles stream eight long rows a
// step from L2, which packing the weights once (about the dot tiles' time
// for 64 tokens) avoids; fewer ranks leave the pack tiles' broadcasts
// serving too few products (#shrink-packs).
constexpr bool ShrinkPacks(int64_t tokens, int64_t ranks) {
  return tokens >= 128 && ranks >= 64;
}

// Where the products are fp32 FMAs on 16 lanes, shrink groups of at least
// 128 tokens and 16 ranks up to two vectors take the pack tiles: their tall
// tiles (16 or 8 tokens) need no horizontal sums nor per-pass widening, one
// broadcast input feeding `ranks` products, and repay packing the weights
// from 128 tokens (rank 32 from 64); fewer ranks leave the broadcasts
// binding, more re-read the packed weights from L2 every 4-5 tokens, and on
// 8 lanes (AVX2) 6 tokens a tile barely beat the dot tiles (#shrink-packs-fma).
constexpr bool ShrinkPacksFma(int64_t tokens, int64_t ranks, int lanes) {
  return lanes >= 16 && tokens >= 128 && ranks >= 16 && ranks <= 2 * lanes;
}

// Expand groups (more outputs than k) of at least 32 tokens with ranks up to
// vLLM's largest max_lora_rank, 512, take the pack tiles even beyond
// kMaxPackK: the dot tiles end each output with a horizontal sum and read
// every weight row again for each token tile, which packing the weights once
// per group outweighs from 32 tokens (#expand-packs).
constexpr bool ExpandPacks(int64_t tokens, int64_t k, int64_t outputs) {
  return outputs > k && k <= 512 && tokens >= 32;
}

// Pack-strategy items of at most 32 tokens of an expand whose packed blocks
// take at least 3 KB (ranks 16 and more on AVX-512 without pair products, 32
// with them, and on AVX2) pack and sweep one block of columns at a time, so
// that it stays in L1 for every token tile instead of being read from L2 by
// each: smaller blocks stream from L2 well enough, and the outputs' rows
// streamed tile by tile win; items of more tokens lose more to packing again
// what the next item of the same columns reuses (#pack-block-by-block).
constexpr bool PackBlockByBlock(int64_t tokens, int64_t block_bytes,
                                bool expand) {
  return expand && tokens <= 32 && block_bytes >= 3072;
}

// Parallelise from this many multiply-adds (one-thread decode calls of
// 4-8 us): a parallel region costs about a microsecond, which a smaller
// call would not win back (#parallel-macs).
constexpr int64_t kParallelMacs = int64_t{1} << 17;

// An expand without bf16 pair products spends about as long on each output
// (its load, widening, rounding and store) as on this many multiply-adds,
// and counts them towards kParallelMacs (#parallel-macs).
constexpr int64_t kExpandOutputMacs = 8;

// Tokens per work item: a multiple of every token tile height.
constexpr int64_t kWorkItemTokens = 64;

// Parallel expands of at least SplitTokensPerThread tokens per thread split
// the tokens among the threads, each writing whole output rows: two threads
// writing parts of the same rows ran 1.2-3x slower than on rows of their
// own; fewer tokens a thread cost the fp32-FMA kernels more than that below
// 64, the bf16 pair kernels below 16, where the rows tiles take over
// (#expand-row-split). `bf16_pairs`: vdpbf16ps or BFDOT kernels.
constexpr int64_t kSplitTokensPerThread = 64;
constexpr int64_t SplitTokensPerThread(bool bf16_pairs) {
  return bf16_pairs ? 16 : kSplitTokensPerThread;
}

// Parallel expands of fewer tokens give each thread an equal share of the
// outputs (tokens x columns); a share ending `near` outputs from one edge of a
// group and `far` from the other ends at the near edge when near is under a
// quarter of far: two threads writing parts of the same rows cost about a
// quarter more, more than that imbalance (#expand-column-split).
constexpr bool ShareEndsAtEdge(int64_t near, int64_t far) {
  return 4 * near < far;
}

// Expand items span as many columns as keep their packed weights within
// about half of this CPU's L2 (#expand-column-blocks), assumed this size
// where the OS does not tell; blocks are whole cache lines.
constexpr int64_t kFallbackL2Bytes = int64_t{2} << 20;
constexpr int64_t kMinColumnsPerItem = 512;
constexpr int64_t kColumnAlign = 64;

// The rank fills one dimension of every AMX tile (expand: the reduction,
// padded to 32; shrink: C's 16 columns): below this rank the tiles multiply
// mostly padding and lose to AVX512-BF16 at any token count (#amx-min-rank).
constexpr int64_t kAmxMinRank = 8;

// Groups of at least AmxMinTokens(pack, rank, rows_in_place) tokens run the
// regular AMX tiles (weights packed into VNNI pairs); smaller ones the
// swapped-operand tiles or AVX512-BF16. A shrink whose input rows the tiles
// read in place pays only for the packing, from 48 tokens; gathering the
// rows too pays from 256 (#amx-min-tokens). `pack`: expand, else shrink.
constexpr int64_t AmxMinTokens(bool pack, int64_t rank, bool rows_in_place) {
  if (rank < kAmxMinRank) return kNever;
  if (pack) return 32;
  return rows_in_place ? 48 : 256;
}

// Groups below AmxMinTokens run the swapped-operand AMX tiles from this many
// tokens, else AVX512-BF16: the tiles' cost barely grows with k and tokens,
// AVX512-BF16's does (#amx-swap-min-tokens). `pack`: expand (k is the
// rank), else shrink (`rows` is the rank).
constexpr int64_t AmxSwapMinTokens(int64_t k, int64_t rows, bool pack) {
  if (pack) {
    return k >= 32 ? 1 : k >= 16 ? 2 : k >= kAmxMinRank ? 4 : kNever;
  }
  return rows >= 16 ? 2 : rows >= kAmxMinRank ? 4 : kNever;
}

// How the kernels multiply the weights: as bf16 pairs (vdpbf16ps), as even
// and odd fp32 halves of bf16, widened to fp32 per vector (fp16, or bf16
// without the split), or as fp32.
enum class WeightProducts { kBf16Pairs, kBf16Halves, kWidened, kFp32 };

// Within the pack blocking, groups of at most RowsMaxTokens(k, grouped)
// tokens read the weight rows in place instead of repacking them: packing's
// transposes pay off only when enough tokens share them (#rows-max-tokens).
// `grouped`: short contiguous rows, several to a vector.
constexpr int kRowsMaxTokens = 8;
constexpr int64_t RowsMaxTokens(int64_t k, bool grouped) {
  if (grouped) return k <= 8 ? 6 : 3;
  return k >= 128 ? 8 : k >= 64 ? 6 : k >= 32 ? 3 : 0;
}
static_assert(RowsMaxTokens(8, true) <= kRowsMaxTokens &&
              RowsMaxTokens(kMaxPackK, false) <= kRowsMaxTokens);

// The same on AVX2: 8 fp32 lanes and no pair products, so a vector holds
// fewer elements of a row and packing transposes cost more per output; 16-bit
// weights are widened once per token in the rows tiles, except rows two to a
// vector (`grouped`: 8 bf16 elements), whose sums take half the shuffles
// (#rows-max-tokens-avx2). Grouped fp16 rows (4 elements) pack with a scalar
// copy, so their rows tiles win to the last token they take
// (#rows-groups-avx2). Ungrouped rows shorter than a vector always pack: a
// rows tile would load each in parts (#short-rows).
constexpr int64_t RowsMaxTokensAvx2(int64_t k, bool grouped, WeightProducts p) {
  if (!grouped && k < 8) return 0;
  if (p == WeightProducts::kFp32 ||
      (grouped && p == WeightProducts::kWidened)) {
    return kRowsMaxTokens;
  }
  if (grouped) return 4;
  return k >= 64 ? 8 : k >= 16 ? 4 : 2;
}
static_assert(RowsMaxTokensAvx2(kMaxPackK, false, WeightProducts::kFp32) <=
              kRowsMaxTokens);

// The same on AVX-512 without pair products: a token's sums in the rows
// tiles weigh half as much beside fp32 FMAs (16 products each, not 32), so
// the rows tiles win longer, up to 8 tokens from rank 16, 4 below; fp16 rows,
// widened once per token there, stop at 6 and 2 (#rows-max-tokens-avx512);
// bf16 rows from rank 32 at 4, where the pack tiles sweep block by block
// (#pack-block-by-block); ungrouped rows shorter than a vector always pack
// (#short-rows).
constexpr int64_t RowsMaxTokensAvx512Fma(int64_t k, bool grouped,
                                         WeightProducts p) {
  if (!grouped && k < 16) return 0;
  if (p == WeightProducts::kWidened) return k >= 32 ? 6 : 2;
  if (p == WeightProducts::kBf16Halves && k >= 32) return 4;
  return k >= 16 ? 8 : 4;
}
static_assert(RowsMaxTokensAvx512Fma(kMaxPackK, false, WeightProducts::kFp32) <=
              kRowsMaxTokens);

// The rows tiles over short rows (RowsTwoTiles) prefetch their weights this
// many bytes ahead: adapters are cold when serving, and there the hardware
// prefetchers alone left the reads waiting on DRAM after the products; longer
// rows ran up to 1.38x slower in cache for the extra loads (#rows-prefetch).
constexpr int64_t kRowsPrefetchBytes = 8192;

// Rows tiles over short rows run two tiles a step: there a tile's sums and
// store outweigh its products, and the second tile's loads and products
// overlap the first's (#rows-two-tiles). `grouped`: rows of 8 or 16
// elements several to a vector (AVX-512); else whole rows of k elements.
constexpr bool RowsTwoTiles(int lanes, int64_t k, bool grouped) {
  return grouped || (lanes == 8 && k <= 16);
}

}  // namespace vllm_cpu_lora
