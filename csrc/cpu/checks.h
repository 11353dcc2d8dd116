// Argument checks of the ops: every argument is checked, with an error naming
// it, before any output memory is touched.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "grouping.h"
#include "kernel_interface.h"
#include "launch.h"

namespace vllm_cpu_lora {

// The range note of adapter index errors.
inline constexpr const char* kLoraRange = " (-1 means no LoRA)";

void CheckCpu(const at::Tensor& t, const char* name);

// The kernels' dtype of t: float32, bfloat16 or float16, else an error.
DType ToDType(const at::Tensor& t, const char* name);

// Rejects an output that shares memory with another argument.
void CheckNoOverlap(const at::Tensor& out, const char* out_name,
                    const at::Tensor& other, const char* other_name);

// [offset, offset + size) within [0, width), without overflow.
bool FitsIn(int64_t offset, int64_t size, int64_t width);

// A 2-D floating-point CPU tensor whose rows are contiguous (t, or a
// contiguous copy).
at::Tensor Matrix(const at::Tensor& t, const char* name);

// Reads the values of a 1-D CPU index tensor of exactly `count` entries
// (`count_note` says why, e.g. "(batches)"), checking each lies in [lo, hi].
// Nothing else is touched before all are checked.
IndexList ReadIndices(const at::Tensor& t, const char* name, int64_t count,
                      const char* count_note, int64_t lo, int64_t hi,
                      const char* range_note);

// Weights [L, rows, cols] (or [L, 1, rows, cols]) with a contiguous last
// dimension.
struct Weights {
  at::Tensor t;  // 3-D view, kept alive for the call.
  int64_t num_adapters, rows, cols;
};

Weights ViewWeights(const at::Tensor& w, const char* name);

// The segments of an sgmv call, checked as vLLM's ops need them: `batches`
// entries each, back to back from token 0, covering all num_tokens.
Segments ReadSegments(const at::Tensor& b_seq_start_loc,
                      const at::Tensor& seq_len_tensor,
                      const at::Tensor& lora_indices_tensor, int64_t batches,
                      int64_t num_tokens, int64_t num_adapters);

// The checks shared by every LoRA op. Returns the product with its ISA, x, w
// and out set, and the weights' view in *w.
Product Prepare(const at::Tensor& inputs, const char* inputs_name,
                const at::Tensor& weights, const char* weights_name,
                const at::Tensor& output, const char* output_name,
                const at::Tensor& index_tensor, Weights* w);

}  // namespace vllm_cpu_lora
