// Plain-C++ interface between the dispatcher (bgmv_cpu.cpp, built with the
// baseline flags) and the per-ISA kernel translation units. Nothing here may
// depend on the ISA: every ISA TU includes this header before its
// `#pragma GCC target`.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace vllm_cpu_lora {

enum class DType : int8_t { kFloat, kBFloat16, kHalf };

// One run of tokens that share an adapter: tokens[token_begin ..
// token_begin + token_count) of LoraArgs::tokens.
struct Group {
  int64_t adapter;
  int64_t token_begin;
  int64_t token_count;
};

// A unit of parallel work: tokens [m0, m1) of a group (positions within the
// group) times output columns [n0, n1).
struct WorkItem {
  int64_t group;
  int64_t m0, m1;
  int64_t n0, n1;
};

// out[t, n] = scale * sum_k x[t, k] * w[a, n, k]  (+ out[t, n] if add),
// for every token t of every group, a the group's adapter. All pointers
// are already offset (e.g. to a slice's first column); the innermost
// dimension of x, w and out is contiguous.
struct LoraArgs {
  const void* x;
  int64_t x_row_stride;
  DType x_dtype;
  const void* w;
  int64_t w_adapter_stride;
  int64_t w_row_stride;
  DType w_dtype;
  void* out;
  int64_t out_row_stride;
  DType out_dtype;
  int64_t k;  // Reduction length (hidden size for shrink, rank for expand).
  float scale;
  bool add;
  const int64_t* tokens;
  const Group* groups;
  // AMX kernels only: groups with fewer tokens (AmxMinTokens) run the
  // swapped-operand tiles (AmxSwapMinTokens, or always where amx_forced) or
  // the AVX512-BF16 kernel.
  int64_t amx_min_tokens;
  bool amx_forced;
};

// Two blockings of the same product: "dot" (long k, few outputs: LoRA
// shrink) runs dot products along k; "pack" (short k, many outputs: LoRA
// expand) repacks a block of weight rows so that output columns are the
// vector lanes.
enum class Strategy : int8_t { kDot, kPack };

// The pack blocking keeps a whole block of weight rows in a stack buffer, so
// it is limited to k <= kMaxPackK.
constexpr int64_t kMaxPackK = 256;

// A group of tokens sharing an adapter goes through the regular AMX tiles
// (weights packed into VNNI pairs, token rows as the A tile) when it has at
// least AmxMinTokens(pack) tokens; smaller groups take the swapped-operand
// tiles or AVX512-BF16 (AmxSwapMinTokens below). `pack`: the pack blocking
// (expand), else dot (shrink). Measured (single thread, H / Hout 4096, time
// regular / swapped): expand rank 16: 1.2 at 16 and 24 tokens per adapter,
// 0.9 at 32. Shrink rank 16: 1.8 at 16, 1.6 at 64; rank 64: 1.5 at 16, 1.7 at
// 64, 1.5 at 128, 1.0 at 256; prefill (512-token segments): 0.7 at ranks 8
// and 16, 1.1 at 64.
constexpr int64_t AmxMinTokens(bool pack) { return pack ? 32 : 256; }

// Token counts no group reaches.
constexpr int64_t kNever = int64_t{1} << 62;

// Groups below AmxMinTokens run the AMX tiles with swapped operands (weights
// as the A operand, read in place; see AmxSwapped) from this many tokens,
// else the AVX512-BF16 kernel.
// `pack`: the pack blocking (expand: k is the rank), else dot (shrink: `rows`
// is the rank). The tiles cost nearly the same per 16 weight rows for k up
// to 64 and up to 8 tokens; AVX512-BF16's cost grows with k and tokens.
// Measured (single thread, one adapter, H / Hout 4096, time AVX512-BF16 /
// swapped AMX; the machine's noise is +-20%): expand rank 8: 0.64 at 1
// token, 0.94 at 3, 1.08 at 4, 1.37 at 8; rank 16: 0.9 at 1, 1.2 at 2, 1.5
// at 3; rank 32: 1.1 at 1, 1.9 at 2; rank 64: 1.3 at 1. Shrink rank 8: 0.75
// at 1, 0.94 at 3, 1.05 at 4, 1.3 at 8; rank 16: 0.86 at 1, 1.05 at 2, 1.3 at
// 3; rank 32: 0.9 at 1, 1.2 at 2; rank 64: 1.25 at 2.
constexpr int64_t AmxSwapMinTokens(int64_t k, int64_t rows, bool pack) {
  if (pack) {
    return k >= 32 ? 1 : k >= 16 ? 2 : k >= 8 ? 4 : kNever;
  }
  return rows >= 16 ? 2 : rows >= 8 ? 4 : kNever;
}

// Within the pack blocking, a group of at most RowsMaxTokens(k, grouped)
// tokens skips the repacking and runs dot products along k over the weight
// rows in place (the "rows" tiles; `grouped`: short contiguous rows, several
// to a vector, see LoraKernel::RowGroupLanes). Both blockings run the same
// number of dot products; rows pay a transpose-add tree per token and 16
// outputs, packing pays transposes per 16 outputs shared by the tokens, which
// grow with k. Measured (single thread, AVX512-BF16, one adapter, Hout 4096,
// 1-8 tokens; rows time / pack time): k 8: 0.55 at 1 token, 0.93 at 8; k 16:
// 0.66 at 1, 0.97 at 4, 1.15 at 6; k 32: 0.57 at 1, 0.87 at 3, 1.0 at 4; k
// 64: 0.5 at 1, 0.8 at 6, 1.0 at 8; k 128: 0.44 at 1, 0.92 at 8.
constexpr int kRowsMaxTokens = 8;
constexpr int64_t RowsMaxTokens(int64_t k, bool grouped) {
  if (grouped) return k <= 8 ? 8 : 4;
  return k >= 128 ? 8 : k >= 64 ? 6 : k >= 32 ? 3 : 0;
}
static_assert(RowsMaxTokens(8, true) <= kRowsMaxTokens &&
              RowsMaxTokens(kMaxPackK, false) <= kRowsMaxTokens);

using KernelFn = void (*)(const LoraArgs&, const WorkItem*, int64_t begin,
                          int64_t end);

struct IsaKernels {
  KernelFn dot;
  KernelFn pack;
  // Preferred token tile height: work items should hold multiples of it.
  int64_t tile_m;
};

// One accessor per ISA translation unit.
namespace scalar {
IsaKernels Kernels();
}
namespace avx2 {
IsaKernels Kernels();
}
namespace avx512 {
IsaKernels Kernels();
}
namespace avx512_bf16 {
IsaKernels Kernels();
}
namespace amx {
IsaKernels Kernels();
}
// The AMX kernel on software-emulated tiles (amx_emulation.h): test-only, so
// the AMX blocking, packing and remainders are checked on CPUs without AMX.
namespace amx_emulated {
IsaKernels Kernels();
}

}  // namespace vllm_cpu_lora
