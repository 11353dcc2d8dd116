// Argument checks of the ops: every argument is checked, with an error naming
// it, before any output memory is touched.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/MaybeOwned.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <ostream>

#include "grouping.h"
#include "kernel_interface.h"
#include "launch.h"

namespace vllm_cpu_lora {

// The range note of adapter index errors.
inline constexpr const char* kLoraRange = " (-1 means no LoRA)";

// An argument's name in error messages: "inputs", or "inputs[2]" for a slice
// of a multi-slice op. Formatted only when a check fails: a decode call
// cannot afford building strings it will not print.
struct ArgName {
  ArgName(const char* name) : name(name) {}  // NOLINT(runtime/explicit)
  ArgName(const char* name, int64_t slice) : name(name), slice(slice) {}
  const char* name;
  int64_t slice = -1;  // -1: the whole argument.
};

std::ostream& operator<<(std::ostream& out, const ArgName& arg);

void CheckCpu(const at::Tensor& t, const ArgName& name);

// The kernels' dtype of t: float32, bfloat16 or float16, else an error.
DType ToDType(const at::Tensor& t, const ArgName& name);

// Rejects an output that shares memory with another argument.
void CheckNoOverlap(const at::Tensor& out, const ArgName& out_name,
                    const at::Tensor& other, const ArgName& other_name);

// [offset, offset + size) within [0, width), without overflow.
bool FitsIn(int64_t offset, int64_t size, int64_t width);

// A 2-D floating-point CPU tensor whose rows are contiguous: t borrowed, or
// a contiguous copy.
c10::MaybeOwned<at::Tensor> Matrix(const at::Tensor& t, const ArgName& name);

// A view of t's storage with the given geometry, made without the
// dispatcher (its select costs ~0.4 us, most of a decode call's cost per
// slice): the CPU dispatch key alone, for the checks and the kernels to
// read, never handed back to the caller.
at::Tensor Alias(const at::Tensor& t, c10::IntArrayRef sizes,
                 c10::IntArrayRef strides, int64_t storage_offset);

// t[0], t[1], ... of a strided tensor of 1 or more dimensions, as Aliases.
c10::SmallVector<at::Tensor, 3> Slices(const at::Tensor& t);

// Reads the values of a 1-D CPU index tensor of exactly `count` entries
// (`count_note` says why, e.g. "(batches)"), checking each lies in [lo, hi].
// Nothing else is touched before all are checked.
IndexList ReadIndices(const at::Tensor& t, const char* name, int64_t count,
                      const char* count_note, int64_t lo, int64_t hi,
                      const char* range_note);

// Weights [L, rows, cols] (or [L, 1, rows, cols]) with a contiguous last
// dimension.
struct Weights {
  // 3-D: the argument borrowed, or a view or copy kept alive for the call.
  c10::MaybeOwned<at::Tensor> t;
  int64_t num_adapters, rows, cols;
};

Weights ViewWeights(const at::Tensor& w, const ArgName& name);

// The segments of an sgmv call, checked as vLLM's ops need them: `batches`
// entries each, back to back from token 0, covering all num_tokens.
Segments ReadSegments(const at::Tensor& b_seq_start_loc,
                      const at::Tensor& seq_len_tensor,
                      const at::Tensor& lora_indices_tensor, int64_t batches,
                      int64_t num_tokens, int64_t num_adapters);

// The checks shared by every LoRA op. Returns the product with its ISA, x, w
// and out set, and the weights' view in *w. The product borrows inputs,
// output and *w: they must outlive it.
Product Prepare(const at::Tensor& inputs, const ArgName& inputs_name,
                const at::Tensor& weights, const ArgName& weights_name,
                const at::Tensor& output, const ArgName& output_name,
                const at::Tensor& index_tensor, Weights* w);

}  // namespace vllm_cpu_lora
