// The LoRA ops: their schemas and registration, and their bodies, which
// check the arguments (checks.h), group the tokens by adapter (grouping.h)
// and run one product per slice (launch.h):
//   out[t, col0 + n] = scale * x[t] . w[a(t), n]  (+ out[t, col0 + n])
// vLLM's per-slice ops (bgmv_*, sgmv_*) take one slice; lora_shrink and
// lora_expand take all the slices of a layer (qkv: 3, gate_up: 2) in one
// call, as vLLM's Triton ops do.
// The kernels live in kernels_<isa>.cpp.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "call_counts.h"
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
  ZeroRows(*p.out, g.no_lora, 0, p.n);
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
  CountCall(OpName::kBgmvShrink);
  Shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling,
         BgmvTokens(inputs, lora_indices_tensor));
}

void BgmvExpandSlice(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                     const at::Tensor& output_tensor,
                     const at::Tensor& lora_indices_tensor,
                     int64_t slice_offset, int64_t slice_size,
                     bool add_inputs) {
  CountCall(OpName::kBgmvExpandSlice);
  ExpandSlice(inputs, lora_b_weights, output_tensor, lora_indices_tensor,
              slice_offset, slice_size, /*exact_slice=*/true, add_inputs,
              BgmvTokens(inputs, lora_indices_tensor));
}

void BgmvExpand(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& lora_indices_tensor, bool add_inputs) {
  CountCall(OpName::kBgmvExpand);
  ExpandSlice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0,
              OutputWidth(output_tensor), /*exact_slice=*/false, add_inputs,
              BgmvTokens(inputs, lora_indices_tensor));
}

namespace {

// The slices of a multi-slice op all have the adapter count of the first:
// the tokens are grouped once for all of them.
void CheckAdapterCounts(const char* name, c10::ArrayRef<Weights> views) {
  for (size_t s = 1; s < views.size(); ++s) {
    TORCH_CHECK(views[s].num_adapters == views[0].num_adapters, name, "[", s,
                "] has ", views[s].num_adapters, " adapters but ", name,
                "[0] has ", views[0].num_adapters);
  }
}

// The tokens of a multi-slice op, grouped by adapter.
Grouping GroupTokens(const at::Tensor& token_lora_indices, int64_t num_tokens,
                     int64_t num_adapters) {
  return GroupByAdapter(
      ReadIndices(token_lora_indices, "token_lora_indices", num_tokens,
                  "(one per token)", -1, num_adapters - 1, kLoraRange),
      num_adapters);
}

// A [slices, tokens, rank] argument of a multi-slice op.
void CheckStacked(const at::Tensor& t, const char* name, int64_t slices,
                  const char* weights_name) {
  TORCH_CHECK(slices > 0, weights_name, " must hold at least one slice");
  CheckCpu(t, name);
  TORCH_CHECK(t.dim() == 3 && t.size(0) == slices, name, " must be [", slices,
              " slices, tokens, rank], got shape ", t.sizes());
}

}  // namespace

// output_tensor[s, t, :rank] = scaling * inputs[t] @ lora_a_weights[s][a(t)].T
// for each slice s, zeros where a(t) = -1.
void LoraShrink(const at::Tensor& inputs, at::TensorList lora_a_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& token_lora_indices, double scaling) {
  CountCall(OpName::kLoraShrink);
  const int64_t slices = static_cast<int64_t>(lora_a_weights.size());
  CheckStacked(output_tensor, "output_tensor", slices, "lora_a_weights");
  // Each slice is checked as a 2-D output below; here, that no two overlap.
  TORCH_CHECK(slices == 1 || output_tensor.numel() == 0 ||
                  output_tensor.stride(0) >=
                      (output_tensor.size(1) - 1) * output_tensor.stride(1) +
                          output_tensor.size(2),
              "output_tensor has slices that share memory");
  // Built before the products, which borrow them.
  const c10::SmallVector<at::Tensor, 3> outputs = Slices(output_tensor);
  c10::SmallVector<Weights, 3> views(slices);
  c10::SmallVector<Product, 3> products;
  for (int64_t s = 0; s < slices; ++s) {
    const ArgName w_name("lora_a_weights", s);
    Product p =
        Prepare(inputs, "inputs", lora_a_weights[s], w_name, outputs[s],
                ArgName("output_tensor", s), token_lora_indices, &views[s]);
    TORCH_CHECK(output_tensor.size(2) >= views[s].rows, "output_tensor has ",
                output_tensor.size(2), " columns, fewer than the rank ",
                views[s].rows, " of ", w_name);
    p.n = views[s].rows;
    p.scale = static_cast<float>(scaling);
    products.push_back(std::move(p));
  }
  // Each slice of the output is checked against its own weights above.
  for (int64_t s = 0; s < slices; ++s) {
    CheckNoOverlap(output_tensor, "output_tensor", lora_a_weights[s],
                   ArgName("lora_a_weights", s));
  }
  CheckAdapterCounts("lora_a_weights", views);
  const Grouping g =
      GroupTokens(token_lora_indices, inputs.size(0), views[0].num_adapters);
  for (const Product& p : products) {
    ZeroRows(*p.out, g.no_lora, 0, p.n);
    Run(p, g.groups, g.tokens);
  }
}

// output_tensor[t, c(s) + n] (+)= inputs[s, t] . lora_b_weights[s][a(t), n]
// for each slice s and n below its weight rows, where c(s) is offset_start
// plus the rows of the slices before s; rows with a(t) = -1 untouched.
void LoraExpand(const at::Tensor& inputs, at::TensorList lora_b_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& token_lora_indices, int64_t offset_start,
                bool add_inputs) {
  CountCall(OpName::kLoraExpand);
  const int64_t slices = static_cast<int64_t>(lora_b_weights.size());
  CheckStacked(inputs, "inputs", slices, "lora_b_weights");
  const int64_t width = OutputWidth(output_tensor);
  TORCH_CHECK(offset_start >= 0 && offset_start <= width, "offset_start ",
              offset_start, " is outside output_tensor of width ", width);
  // Built before the products, which borrow them.
  const c10::SmallVector<at::Tensor, 3> slice_inputs = Slices(inputs);
  c10::SmallVector<Weights, 3> views(slices);
  c10::SmallVector<Product, 3> products;
  int64_t col = offset_start;
  for (int64_t s = 0; s < slices; ++s) {
    Product p =
        Prepare(slice_inputs[s], ArgName("inputs", s), lora_b_weights[s],
                ArgName("lora_b_weights", s), output_tensor, "output_tensor",
                token_lora_indices, &views[s]);
    TORCH_CHECK(views[s].rows <= width - col, "offset_start ", offset_start,
                " and the rows of lora_b_weights[0..", s, "] (",
                col - offset_start + views[s].rows,
                ") do not fit in output_tensor of width ", width);
    p.col0 = col;
    p.n = views[s].rows;
    p.add = add_inputs;
    col += p.n;
    products.push_back(std::move(p));
  }
  CheckAdapterCounts("lora_b_weights", views);
  const Grouping g = GroupTokens(token_lora_indices, output_tensor.size(0),
                                 views[0].num_adapters);
  for (const Product& p : products) Run(p, g.groups, g.tokens);
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
  CountCall(OpName::kSgmvShrink);
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
  CountCall(OpName::kSgmvExpandSlice);
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
  CountCall(OpName::kSgmvExpand);
  ExpandSlice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0,
              OutputWidth(output_tensor), /*exact_slice=*/false, add_inputs,
              SgmvTokens(inputs, b_seq_start_loc, seq_len_tensor,
                         lora_indices_tensor, batches));
}

// Legacy punica: y[:, y_offset:y_offset+h_out] += scale * x[:, :h_in] @
// w[idx, layer_idx, :h_out, :h_in].T; negative indices skip the row.
void BgmvLowLevel(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& indicies, int64_t layer_idx, double scale,
                  int64_t h_in, int64_t h_out, int64_t y_offset) {
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
  const c10::MaybeOwned<at::Tensor> x_in = Matrix(x, "x");
  TORCH_CHECK(x_in->size(1) == h_in, "x has ", x_in->size(1),
              " columns but h_in is ", h_in);
  TORCH_CHECK(y.dim() == 2, "y must be 2-D, got shape ", y.sizes());
  TORCH_CHECK(FitsIn(y_offset, h_out, y.size(1)), "y_offset ", y_offset,
              " and h_out ", h_out, " do not fit in y of width ", y.size(1));
  const at::Tensor w3 =
      w.select(1, layer_idx).narrow(1, 0, h_out).narrow(2, 0, h_in);
  Weights wv;
  Product p = Prepare(*x_in, "x", w3, "w", y, "y", indicies, &wv);
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
  CountCall(OpName::kDispatchBgmv);
  TORCH_CHECK(w.dim() == 4,
              "w must be [num_loras, num_layers, h_out, h_in], got shape ",
              w.sizes());
  BgmvLowLevel(y, x, w, indicies, layer_idx, scale, w.size(3), w.size(2), 0);
}

void DispatchBgmvLowLevel(const at::Tensor& y, const at::Tensor& x,
                          const at::Tensor& w, const at::Tensor& indicies,
                          int64_t layer_idx, double scale, int64_t h_in,
                          int64_t h_out, int64_t y_offset) {
  CountCall(OpName::kDispatchBgmvLowLevel);
  BgmvLowLevel(y, x, w, indicies, layer_idx, scale, h_in, h_out, y_offset);
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
  m.def(
      "lora_shrink(Tensor inputs, Tensor[] lora_a_weights, "
      "Tensor(a!) output_tensor, Tensor token_lora_indices, "
      "float scaling=1.0) -> ()");
  m.def(
      "lora_expand(Tensor inputs, Tensor[] lora_b_weights, "
      "Tensor(a!) output_tensor, Tensor token_lora_indices, "
      "int offset_start=0, bool add_inputs=True) -> ()");
  m.def("isa() -> str", &IsaName);
  m.def("supported_isas() -> str[]", &SupportedIsas);
  m.def("built_isas() -> str[]", &BuiltIsas);
}

TORCH_LIBRARY_IMPL(vllm_cpu_lora, CPU, m) {
  m.impl("bgmv_shrink", &BgmvShrink);
  m.impl("bgmv_expand", &BgmvExpand);
  m.impl("bgmv_expand_slice", &BgmvExpandSlice);
  m.impl("sgmv_shrink", &SgmvShrink);
  m.impl("sgmv_expand", &SgmvExpand);
  m.impl("sgmv_expand_slice", &SgmvExpandSlice);
  m.impl("lora_shrink", &LoraShrink);
  m.impl("lora_expand", &LoraExpand);
  m.impl("dispatch_bgmv", &DispatchBgmv);
  m.impl("dispatch_bgmv_low_level", &DispatchBgmvLowLevel);
}

}  // namespace vllm_cpu_lora
