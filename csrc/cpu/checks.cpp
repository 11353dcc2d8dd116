#include "checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <utility>

namespace vllm_cpu_lora {

std::ostream& operator<<(std::ostream& out, const ArgName& arg) {
  out << arg.name;
  if (arg.slice >= 0) out << "[" << arg.slice << "]";
  return out;
}

void CheckCpu(const at::Tensor& t, const ArgName& name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ",
              t.device());
}

DType ToDType(const at::Tensor& t, const ArgName& name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kHalf;
    default:
      TORCH_CHECK(false, name, " must be float32, bfloat16 or float16, got ",
                  t.scalar_type());
  }
}

// Where torch cannot tell (at::get_overlap_status answers TooHard for non-dense
// views), any overlap of the two byte ranges counts: a false alarm is an error
// message, a missed one a silently wrong result.
void CheckNoOverlap(const at::Tensor& out, const ArgName& out_name,
                    const at::Tensor& other, const ArgName& other_name) {
  const auto status = at::get_overlap_status(out, other);
  bool overlap = status == at::MemOverlapStatus::Full ||
                 status == at::MemOverlapStatus::Partial;
  if (status == at::MemOverlapStatus::TooHard && out.numel() > 0 &&
      other.numel() > 0) {
    auto range = [](const at::Tensor& t) {
      int64_t extent = 1;
      for (int64_t d = 0; d < t.dim(); ++d) {
        extent += (t.size(d) - 1) * std::abs(t.stride(d));
      }
      const char* begin = static_cast<const char*>(t.const_data_ptr());
      return std::make_pair(begin, begin + extent * t.element_size());
    };
    const auto [a0, a1] = range(out);
    const auto [b0, b1] = range(other);
    overlap = a0 < b1 && b0 < a1;
  }
  TORCH_CHECK(!overlap, out_name, " must not share memory with ", other_name);
}

bool FitsIn(int64_t offset, int64_t size, int64_t width) {
  return offset >= 0 && size >= 0 && offset <= width && size <= width - offset;
}

c10::MaybeOwned<at::Tensor> Matrix(const at::Tensor& t, const ArgName& name) {
  CheckCpu(t, name);
  ToDType(t, name);
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got shape ", t.sizes());
  if (t.stride(1) == 1 || t.size(1) <= 1) {
    return c10::MaybeOwned<at::Tensor>::borrowed(t);
  }
  return c10::MaybeOwned<at::Tensor>::owned(t.contiguous());
}

at::Tensor Alias(const at::Tensor& t, c10::IntArrayRef sizes,
                 c10::IntArrayRef strides, int64_t storage_offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(t.storage()),
      c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(sizes, strides, storage_offset);
  return at::Tensor(std::move(impl));
}

c10::SmallVector<at::Tensor, 3> Slices(const at::Tensor& t) {
  c10::SmallVector<at::Tensor, 3> slices;
  for (int64_t s = 0; s < t.size(0); ++s) {
    slices.push_back(Alias(t, t.sizes().slice(1), t.strides().slice(1),
                           t.storage_offset() + s * t.stride(0)));
  }
  return slices;
}

IndexList ReadIndices(const at::Tensor& t, const char* name, int64_t count,
                      const char* count_note, int64_t lo, int64_t hi,
                      const char* range_note) {
  CheckCpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name,
              " must be an int64 or int32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.size(0) == count, name, " has ", t.size(0),
              " entries, expected ", count, " ", count_note);
  IndexList values(count);
  const int64_t stride = t.stride(0);
  if (t.scalar_type() == at::kLong) {
    const int64_t* p = t.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) values[i] = p[i * stride];
  } else {
    const int32_t* p = t.const_data_ptr<int32_t>();
    for (int64_t i = 0; i < count; ++i) values[i] = p[i * stride];
  }
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(values[i] >= lo && values[i] <= hi, name, "[", i,
                "] = ", values[i], " is out of range: valid values are ", lo,
                " to ", hi, range_note);
  }
  return values;
}

Weights ViewWeights(const at::Tensor& w, const ArgName& name) {
  CheckCpu(w, name);
  ToDType(w, name);
  TORCH_CHECK(w.dim() == 3 || (w.dim() == 4 && w.size(1) == 1), name,
              " must be [num_loras, rows, cols] or [num_loras, 1, rows, "
              "cols], got shape ",
              w.sizes());
  // w.select(1, 0) of vLLM's [L, 1, rows, cols] stacks, as an Alias.
  auto w3 = w.dim() == 4 ? c10::MaybeOwned<at::Tensor>::owned(
                               Alias(w, {w.size(0), w.size(2), w.size(3)},
                                     {w.stride(0), w.stride(2), w.stride(3)},
                                     w.storage_offset()))
                         : c10::MaybeOwned<at::Tensor>::borrowed(w);
  if (w3->stride(2) != 1 && w3->size(2) > 1) {
    w3 = c10::MaybeOwned<at::Tensor>::owned(w3->contiguous());
  }
  const int64_t num_adapters = w3->size(0), rows = w3->size(1),
                cols = w3->size(2);
  return Weights{std::move(w3), num_adapters, rows, cols};
}

Segments ReadSegments(const at::Tensor& b_seq_start_loc,
                      const at::Tensor& seq_len_tensor,
                      const at::Tensor& lora_indices_tensor, int64_t batches,
                      int64_t num_tokens, int64_t num_adapters) {
  TORCH_CHECK(batches >= 0, "batches must be >= 0, got ", batches);
  Segments s;
  s.start = ReadIndices(b_seq_start_loc, "b_seq_start_loc", batches,
                        "(batches)", 0, num_tokens, " (token positions)");
  s.len = ReadIndices(seq_len_tensor, "seq_len_tensor", batches, "(batches)", 0,
                      num_tokens, " (segment lengths)");
  s.lora = ReadIndices(lora_indices_tensor, "lora_indices_tensor", batches,
                       "(batches)", -1, num_adapters - 1, kLoraRange);
  // vLLM's ops run the segments back to back from token 0 (they read no
  // b_seq_start_loc) and need them to cover every input row.
  int64_t next = 0;
  for (int64_t i = 0; i < batches; ++i) {
    TORCH_CHECK(s.start[i] == next, "b_seq_start_loc[", i, "] = ", s.start[i],
                " but segment ", i, " must start at token ", next,
                ": segments run back to back from token 0 (each start is the "
                "sum of the seq_len_tensor entries before it)");
    TORCH_CHECK(s.len[i] <= num_tokens - next, "seq_len_tensor[0..", i,
                "] sums to more than the ", num_tokens, " rows of inputs");
    next += s.len[i];
  }
  TORCH_CHECK(next == num_tokens, "seq_len_tensor sums to ", next,
              " tokens but inputs has ", num_tokens,
              " rows: the segments must cover every row");
  return s;
}

Product Prepare(const at::Tensor& inputs, const ArgName& inputs_name,
                const at::Tensor& weights, const ArgName& weights_name,
                const at::Tensor& output, const ArgName& output_name,
                const at::Tensor& index_tensor, Weights* w) {
  Product p;
  p.isa = SelectIsa();
  p.x = Matrix(inputs, inputs_name);
  *w = ViewWeights(weights, weights_name);
  CheckCpu(output, output_name);
  ToDType(output, output_name);
  TORCH_CHECK(output.dim() == 2, output_name, " must be 2-D, got shape ",
              output.sizes());
  TORCH_CHECK(output.stride(1) == 1 || output.size(1) <= 1, output_name,
              " must have a contiguous last dimension, got strides ",
              output.strides());
  // Rows of a 2-D output with unit column stride overlap exactly when the
  // row stride is below the width (has_internal_overlap may say TooHard).
  TORCH_CHECK(at::has_internal_overlap(output) != at::MemOverlap::Yes &&
                  (output.size(0) <= 1 || output.size(1) == 0 ||
                   output.stride(0) >= output.size(1)),
              output_name, " has elements that share memory");
  TORCH_CHECK(output.size(0) == inputs.size(0), output_name, " has ",
              output.size(0), " rows but ", inputs_name, " has ",
              inputs.size(0));
  TORCH_CHECK(inputs.size(1) == w->cols, inputs_name, " has ", inputs.size(1),
              " columns but ", weights_name, " expects ", w->cols,
              " (its last dimension)");
  CheckNoOverlap(output, output_name, inputs, inputs_name);
  CheckNoOverlap(output, output_name, weights, weights_name);
  CheckNoOverlap(output, output_name, index_tensor, "the index tensors");
  p.w = c10::MaybeOwned<at::Tensor>::borrowed(*w->t);
  p.out = c10::MaybeOwned<at::Tensor>::borrowed(output);
  return p;
}

}  // namespace vllm_cpu_lora
