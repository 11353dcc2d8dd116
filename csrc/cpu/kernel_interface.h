// The interface between the dispatcher (launch.cpp, built with the baseline
// flags) and the per-ISA kernel translation units: the product's arguments,
// its work items and the kernel table. Nothing here may depend on the ISA:
// every ISA TU includes this header before its `#pragma GCC target`.
#pragma once

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
  // AMX kernels only: groups below AmxMinTokens run the swapped-operand
  // tiles always (else from AmxSwapMinTokens) or the AVX512-BF16 kernel.
  bool amx_forced;
};

using KernelFn = void (*)(const LoraArgs&, const WorkItem*, int64_t begin,
                          int64_t end);

// The two blockings of the same product: `dot` (long k, few outputs: LoRA
// shrink) runs dot products along k; `pack` (short k, many outputs: LoRA
// expand) repacks a block of weight rows so that output columns are the
// vector lanes (or, for a few tokens, reads the rows in place).
struct IsaKernels {
  KernelFn dot;
  KernelFn pack;
  bool bf16_pairs;  // bf16 pair products (vdpbf16ps, AMX, BFDOT).
  // Parallel expands of this many tokens a thread or more split the tokens
  // among the threads (tuning.h).
  int64_t split_tokens_per_thread;
};

// One accessor per ISA translation unit; all but scalar's are built on their
// architecture only (x86-64: avx2 to amx_emulated; aarch64: neon, neon_bf16),
// and only where the build selects them (VLLM_CPU_LORA_BUILD_ISAS,
// build_isas.py). Those are weak: an accessor whose unit was not linked in
// has the address null, which is how isa.cpp tells what was built.
#define VLLM_CPU_LORA_OPTIONAL __attribute__((weak))
namespace scalar {
IsaKernels Kernels();
}
namespace avx2 {
VLLM_CPU_LORA_OPTIONAL IsaKernels Kernels();
}
namespace avx512 {
VLLM_CPU_LORA_OPTIONAL IsaKernels Kernels();
}
namespace avx512_bf16 {
VLLM_CPU_LORA_OPTIONAL IsaKernels Kernels();
}
namespace amx {
VLLM_CPU_LORA_OPTIONAL IsaKernels Kernels();
}
// The AMX kernel on software-emulated tiles (amx_emulation.h): test-only, so
// the AMX blocking, packing and remainders are checked on CPUs without AMX.
namespace amx_emulated {
VLLM_CPU_LORA_OPTIONAL IsaKernels Kernels();
}
namespace neon {
VLLM_CPU_LORA_OPTIONAL IsaKernels Kernels();
}
namespace neon_bf16 {
VLLM_CPU_LORA_OPTIONAL IsaKernels Kernels();
}
#undef VLLM_CPU_LORA_OPTIONAL

}  // namespace vllm_cpu_lora
