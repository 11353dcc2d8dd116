// Work planning and launch: a product's tokens and columns cut into work
// items, spread over threads (or its reduction split, for a shrink of a few
// tokens), and run by the chosen ISA's kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/MaybeOwned.h>

#include <cstdint>

#include "isa.h"
#include "kernel_interface.h"

namespace vllm_cpu_lora {

// One product over `groups`: columns [col0, col0 + n) of `out`. The tensors
// are mostly borrowed: a copy of a tensor Python owns costs a GIL round trip
// to count the reference.
struct Product {
  IsaChoice isa;                    // Chosen before anything is written.
  c10::MaybeOwned<at::Tensor> x;    // [T, k]
  c10::MaybeOwned<at::Tensor> w;    // [L, >= n, k] (3-D, last dim contiguous)
  c10::MaybeOwned<at::Tensor> out;  // [T, >= col0 + n]
  int64_t col0 = 0;
  int64_t n = 0;
  float scale = 1.0f;
  bool add = false;
};

// Runs the product for the tokens of `groups` (runs of `tokens`).
void Run(const Product& p, c10::ArrayRef<Group> groups,
         c10::ArrayRef<int64_t> tokens);

// Zeroes columns [col0, col0 + cols) of the given rows of `out` (shrink's
// rows without an adapter).
void ZeroRows(const at::Tensor& out, c10::ArrayRef<int64_t> rows, int64_t col0,
              int64_t cols);

}  // namespace vllm_cpu_lora
