// The LoRA ops: their schemas and registration, and their bodies, which
// check the arguments (checks.h), group the tokens by adapter (grouping.h)
// and run one product (launch.h):
//   out[t, col0 + n] = scale * x[t] . w[a(t), n]  (+ out[t, col0 + n])
// The kernels live in kernels_<isa>.cpp.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "checks.h"
#include "grouping.h"
#include "isa.h"
#include "launch.h"
#include "ops.h"

namespace vllm_cpu_lora {

namespace {

// Each op's adapter assignment, read and checked after the shared checks:
// group(num_adapters) returns the tokens grouped by adapter.
auto BgmvTokens(const at::Tensor& inputs,
                const at::Tensor& lora_indices_tensor) {
  return [&](int64_t num_adapters) {
    return GroupByAdapter(
        ReadIndices(lora_indices_tensor, "lora_indices_tensor", inputs.size(0),
                    "(one per row of inputs)", -1, num_adapters - 1,
                    kLoraRange),
        num_adapters);
  };
}

auto SgmvTokens(const at::Tensor& inputs, const at::Tensor& b_seq_start_loc,
                const at::Tensor& seq_len_tensor,
                const at::Tensor& lora_indices_tensor, int64_t batches) {
  return [&, batches](int64_t num_adapters) {
    return GroupSegments(
        ReadSegments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                     batches, inputs.size(0), num_adapters),
        num_adapters);
  };
}

// output_tensor[t, :rank] = scaling * inputs[t] @ lora_a_weights[a(t)].T,
// zeros where a(t) = -1.
template <class GroupTokens>
void Shrink(const at::Tensor& inputs, const at::Tensor& lora_a_weights,
            const at::Tensor& output_tensor,
            const at::Tensor& lora_indices_tensor, double scaling,
            GroupTokens group) {
  Weights w;
  Product p = Prepare(inputs, "inputs", lora_a_weights, "lora_a_weights",
                      output_tensor, "output_tensor", lora_indices_tensor, &w);
  TORCH_CHECK(output_tensor.size(1) >= w.rows, "output_tensor has ",
              output_tensor.size(1), " columns, fewer than the rank ", w.rows,
              " of lora_a_weights");
  const Grouping g = group(w.num_adapters);
  p.n = w.rows;
  p.scale = static_cast<float>(scaling);
  ZeroRows(p.out, g.no_lora, p.n);
  Run(p, g.groups, g.tokens);
}

// output_tensor[t, slice_offset + n] (+)= inputs[t] . lora_b_weights[a(t), n]
// for n < the weight rows; rows with a(t) = -1 untouched. `exact_slice`
// (the *_expand_slice ops): the weight rows must be slice_size, as vLLM's
// ops require; else (the *_expand ops) the slice is clipped to them, as
// adapter and model may pad differently.
template <class GroupTokens>
void ExpandSlice(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                 const at::Tensor& output_tensor,
                 const at::Tensor& lora_indices_tensor, int64_t slice_offset,
                 int64_t slice_size, bool exact_slice, bool add_inputs,
                 GroupTokens group) {
  Weights w;
  Product p = Prepare(inputs, "inputs", lora_b_weights, "lora_b_weights",
                      output_tensor, "output_tensor", lora_indices_tensor, &w);
  TORCH_CHECK(FitsIn(slice_offset, slice_size, output_tensor.size(1)),
              "slice_offset ", slice_offset, " and slice_size ", slice_size,
              " do not fit in output_tensor of width ", output_tensor.size(1));
  TORCH_CHECK(!exact_slice || slice_size == w.rows, "slice_size ", slice_size,
              " differs from the ", w.rows, " rows of lora_b_weights");
  const Grouping g = group(w.num_adapters);
  p.col0 = slice_offset;
  p.n = std::min(w.rows, slice_size);
  p.add = add_inputs;
  Run(p, g.groups, g.tokens);
}

// The width of an expand's output, checked 2-D.
int64_t OutputWidth(const at::Tensor& output_tensor) {
  TORCH_CHECK(output_tensor.dim() == 2, "output_tensor must be 2-D, got shape ",
              output_tensor.sizes());
  return output_tensor.size(1);
}

}  // namespace

void BgmvShrink(const at::Tensor& inputs, const at::Tensor& lora_a_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& lora_indices_tensor, double scaling) {
  Shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling,
         BgmvTokens(inputs, lora_indices_tensor));
}

void BgmvExpandSlice(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                     const at::Tensor& output_tensor,
                     const at::Tensor& lora_indices_tensor,
                     int64_t slice_offset, int64_t slice_size,
                     bool add_inputs) {
  ExpandSlice(inputs, lora_b_weights, output_tensor, lora_indices_tensor,
              slice_offset, slice_size, /*exact_slice=*/true, add_inputs,
              BgmvTokens(inputs, lora_indices_tensor));
}

void BgmvExpand(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& lora_indices_tensor, bool add_inputs) {
  ExpandSlice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0,
              OutputWidth(output_tensor), /*exact_slice=*/false, add_inputs,
              BgmvTokens(inputs, lora_indices_tensor));
}

namespace {

// max_seq_length and token_nums are hints only: the segments are read and
// checked.
void SgmvShrink(const at::Tensor& inputs, const at::Tensor& lora_a_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& b_seq_start_loc,
                const at::Tensor& seq_len_tensor,
                const at::Tensor& lora_indices_tensor, int64_t batches,
                int64_t /*max_seq_length*/, int64_t /*token_nums*/,
                double scaling) {
  Shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling,
         SgmvTokens(inputs, b_seq_start_loc, seq_len_tensor,
                    lora_indices_tensor, batches));
}

void SgmvExpandSlice(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                     const at::Tensor& output_tensor,
                     const at::Tensor& b_seq_start_loc,
                     const at::Tensor& seq_len_tensor,
                     const at::Tensor& lora_indices_tensor, int64_t batches,
                     int64_t /*max_seq_length*/, int64_t /*token_nums*/,
                     int64_t slice_offset, int64_t slice_size,
                     bool add_inputs) {
  ExpandSlice(inputs, lora_b_weights, output_tensor, lora_indices_tensor,
              slice_offset, slice_size, /*exact_slice=*/true, add_inputs,
              SgmvTokens(inputs, b_seq_start_loc, seq_len_tensor,
                         lora_indices_tensor, batches));
}

void SgmvExpand(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& b_seq_start_loc,
                const at::Tensor& seq_len_tensor,
                const at::Tensor& lora_indices_tensor, int64_t batches,
                int64_t /*max_seq_length*/, int64_t /*token_nums*/,
                bool add_inputs) {
  ExpandSlice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0,
              OutputWidth(output_tensor), /*exact_slice=*/false, add_inputs,
              SgmvTokens(inputs, b_seq_start_loc, seq_len_tensor,
                         lora_indices_tensor, batches));
}

// Legacy punica: y[:, y_offset:y_offset+h_out] += scale * x[:, :h_in] @
// w[idx, layer_idx, :h_out, :h_in].T; negative indices skip the row.
void DispatchBgmvLowLevel(const at::Tensor& y, const at::Tensor& x,
                          const at::Tensor& w, const at::Tensor& indicies,
                          int64_t layer_idx, double scale, int64_t h_in,
                          int64_t h_out, int64_t y_offset) {
  CheckCpu(w, "w");
  ToDType(w, "w");
  TORCH_CHECK(w.dim() == 4,
              "w must be [num_loras, num_layers, h_out, h_in], got shape ",
              w.sizes());
  TORCH_CHECK(layer_idx >= 0 && layer_idx < w.size(1), "layer_idx ", layer_idx,
              " is out of range for w with ", w.size(1), " layers");
  TORCH_CHECK(h_in >= 0 && h_in <= w.size(3), "h_in ", h_in,
              " must be between 0 and w.size(3) = ", w.size(3));
  TORCH_CHECK(h_out >= 0 && h_out <= w.size(2), "h_out ", h_out,
              " must be between 0 and w.size(2) = ", w.size(2));
  const at::Tensor x_in = Matrix(x, "x");
  TORCH_CHECK(x_in.size(1) == h_in, "x has ", x_in.size(1),
              " columns but h_in is ", h_in);
  TORCH_CHECK(y.dim() == 2, "y must be 2-D, got shape ", y.sizes());
  TORCH_CHECK(FitsIn(y_offset, h_out, y.size(1)), "y_offset ", y_offset,
              " and h_out ", h_out, " do not fit in y of width ", y.size(1));
  const at::Tensor w3 =
      w.select(1, layer_idx).narrow(1, 0, h_out).narrow(2, 0, h_in);
  Weights wv;
  Product p = Prepare(x_in, "x", w3, "w", y, "y", indicies, &wv);
  CheckNoOverlap(y, "y", w, "w");
  // Entries past x's rows are not read (no vLLM op defines this one).
  const bool longer = indicies.dim() == 1 && indicies.size(0) > x.size(0);
  auto indices = ReadIndices(
      longer ? indicies.narrow(0, 0, x.size(0)) : indicies, "indicies",
      x.size(0), "(one per row of x)", std::numeric_limits<int64_t>::min(),
      wv.num_adapters - 1, " (negative skips the row)");
  for (int64_t& i : indices) i = std::max<int64_t>(i, -1);
  const Grouping g = GroupByAdapter(indices, wv.num_adapters);
  p.col0 = y_offset;
  p.n = h_out;
  p.scale = static_cast<float>(scale);
  p.add = true;
  Run(p, g.groups, g.tokens);
}

void DispatchBgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& indicies, int64_t layer_idx, double scale) {
  TORCH_CHECK(w.dim() == 4,
              "w must be [num_loras, num_layers, h_out, h_in], got shape ",
              w.sizes());
  DispatchBgmvLowLevel(y, x, w, indicies, layer_idx, scale, w.size(3),
                       w.size(2), 0);
}

}  // namespace

TORCH_LIBRARY(vllm_cpu_lora, m) {
  m.def(
      "bgmv_shrink(Tensor inputs, Tensor lora_a_weights, "
      "Tensor(a!) output_tensor, Tensor lora_indices_tensor, "
      "float scaling=1.0) -> ()");
  m.def(
      "bgmv_expand(Tensor inputs, Tensor lora_b_weights, "
      "Tensor(a!) output_tensor, Tensor lora_indices_tensor, "
      "bool add_inputs=True) -> ()");
  m.def(
      "bgmv_expand_slice(Tensor inputs, Tensor lora_b_weights, "
      "Tensor(a!) output_tensor, Tensor lora_indices_tensor, "
      "int slice_offset, int slice_size, bool add_inputs=True) -> ()");
  m.def(
      "sgmv_shrink(Tensor inputs, Tensor lora_a_weights, "
      "Tensor(a!) output_tensor, Tensor b_seq_start_loc, "
      "Tensor seq_len_tensor, Tensor lora_indices_tensor, int batches, "
      "int max_seq_length, int token_nums, float scaling) -> ()");
  m.def(
      "sgmv_expand(Tensor inputs, Tensor lora_b_weights, "
      "Tensor(a!) output_tensor, Tensor b_seq_start_loc, "
      "Tensor seq_len_tensor, Tensor lora_indices_tensor, int batches, "
      "int max_seq_length, int token_nums, bool add_inputs=False) -> ()");
  m.def(
      "sgmv_expand_slice(Tensor inputs, Tensor lora_b_weights, "
      "Tensor(a!) output_tensor, Tensor b_seq_start_loc, "
      "Tensor seq_len_tensor, Tensor lora_indices_tensor, int batches, "
      "int max_seq_length, int token_nums, int slice_offset, "
      "int slice_size, bool add_inputs=False) -> ()");
  m.def(
      "dispatch_bgmv(Tensor(a!) y, Tensor x, Tensor w, Tensor indicies, "
      "int layer_idx, float scale) -> ()");
  m.def(
      "dispatch_bgmv_low_level(Tensor(a!) y, Tensor x, Tensor w, "
      "Tensor indicies, int layer_idx, float scale, int h_in, int h_out, "
      "int y_offset) -> ()");
  m.def("isa() -> str", &IsaName);
  m.def("supported_isas() -> str[]", &SupportedIsas);
}

TORCH_LIBRARY_IMPL(vllm_cpu_lora, CPU, m) {
  m.impl("bgmv_shrink", &BgmvShrink);
  m.impl("bgmv_expand", &BgmvExpand);
  m.impl("bgmv_expand_slice", &BgmvExpandSlice);
  m.impl("sgmv_shrink", &SgmvShrink);
  m.impl("sgmv_expand", &SgmvExpand);
  m.impl("sgmv_expand_slice", &SgmvExpandSlice);
  m.impl("dispatch_bgmv", &DispatchBgmv);
  m.impl("dispatch_bgmv_low_level", &DispatchBgmvLowLevel);
}

}  // namespace vllm_cpu_lora
