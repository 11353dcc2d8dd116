// Op schemas, registration, argument checks and ISA dispatch for the LoRA
// ops. Built with the baseline flags; the kernels live in kernels_<isa>.cpp.
//
// Every op reduces to one product (bgmv_params.h):
//   out[t, col0 + n] = scale * x[t] . w[a(t), n]  (+ out[t, col0 + n])
// over groups of tokens that share an adapter, so each adapter's weights are
// streamed once per call for all of its tokens.

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "bgmv_params.h"
#include "ops.h"

namespace vllm_cpu_lora {
namespace {

// Per-call lists with inline storage sized for decode batches, so a small
// call makes no heap allocation (each is tens of nanoseconds of a ~0.5 us
// call); larger ones spill to the heap.
using IndexList = c10::SmallVector<int64_t, 64>;
using GroupList = c10::SmallVector<Group, 16>;

// ------------------------------------------------------------------ ISA --

// In order of preference; kAmxEmulated (test-only) is never chosen unless
// forced.
enum class Isa : int {
  kScalar,
  kAvx2,
  kAvx512,
  kAvx512Bf16,
  kAmx,
  kAmxEmulated,
  kCount
};

constexpr const char* kIsaNames[] = {"scalar",      "avx2", "avx512",
                                     "avx512_bf16", "amx",  "amx_emulated"};

struct CpuFeatures {
  bool supported[static_cast<int>(Isa::kCount)];
};

const CpuFeatures& Features() {
  static const CpuFeatures features = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    auto has = [&](const char* key) {
      const auto it = caps.find(key);
      return it != caps.end() && it->second.isBool() && it->second.toBool();
    };
    const bool avx2 = has("avx2") && has("fma3") && has("f16c");
    const bool avx512 = avx2 && has("avx512_f") && has("avx512_bw") &&
                        has("avx512_vl") && has("avx512_dq");
    CpuFeatures f{};
    f.supported[static_cast<int>(Isa::kScalar)] = true;
    f.supported[static_cast<int>(Isa::kAvx2)] = avx2;
    f.supported[static_cast<int>(Isa::kAvx512)] = avx512;
    const bool avx512_bf16 = avx512 && has("avx512_bf16");
    f.supported[static_cast<int>(Isa::kAvx512Bf16)] = avx512_bf16;
    // AMX also needs the OS to grant tile state (arch_prctl, via torch).
    f.supported[static_cast<int>(Isa::kAmx)] = avx512_bf16 && has("amx_bf16") &&
                                               has("amx_tile") &&
                                               at::cpu::init_amx();
    f.supported[static_cast<int>(Isa::kAmxEmulated)] = avx512_bf16;
    return f;
  }();
  return features;
}

bool IsSupported(Isa isa) {
  return Features().supported[static_cast<int>(isa)];
}

// Supported paths, best first, the test-only emulation last.
std::vector<std::string> SupportedIsas() {
  std::vector<std::string> names;
  for (int i = static_cast<int>(Isa::kAmx); i >= 0; --i) {
    if (IsSupported(static_cast<Isa>(i))) names.push_back(kIsaNames[i]);
  }
  if (IsSupported(Isa::kAmxEmulated)) names.push_back("amx_emulated");
  return names;
}

std::string SupportedList() {
  std::string list;
  for (const std::string& name : SupportedIsas()) {
    list += (list.empty() ? "" : ", ") + name;
  }
  return list;
}

struct IsaChoice {
  Isa isa;
  bool forced;
};

// The best ISA of this CPU, or the one VLLM_CPU_LORA_ISA forces. The variable
// is read on every call (a getenv is ~100 ns), so tests can switch paths.
IsaChoice SelectIsa() {
  const char* forced = std::getenv("VLLM_CPU_LORA_ISA");
  if (forced != nullptr && *forced != '\0') {
    for (int i = 0; i < static_cast<int>(Isa::kCount); ++i) {
      if (std::string(forced) != kIsaNames[i]) continue;
      TORCH_CHECK(
          IsSupported(static_cast<Isa>(i)), "VLLM_CPU_LORA_ISA=", forced,
          " is not supported by this CPU (supported: ", SupportedList(), ")");
      return IsaChoice{static_cast<Isa>(i), true};
    }
    TORCH_CHECK(false, "VLLM_CPU_LORA_ISA=", forced,
                " is not a known ISA path (known: amx, avx512_bf16, avx512, "
                "avx2, scalar, amx_emulated; supported here: ",
                SupportedList(), ")");
  }
  for (int i = static_cast<int>(Isa::kAmx); i > 0; --i) {
    if (IsSupported(static_cast<Isa>(i))) {
      return IsaChoice{static_cast<Isa>(i), false};
    }
  }
  return IsaChoice{Isa::kScalar, false};
}

const IsaKernels& KernelsFor(Isa isa) {
  static const IsaKernels table[] = {
      scalar::Kernels(),      avx2::Kernels(), avx512::Kernels(),
      avx512_bf16::Kernels(), amx::Kernels(),  amx_emulated::Kernels()};
  return table[static_cast<int>(isa)];
}

// --------------------------------------------------------------- checks --

void CheckCpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ",
              t.device());
}

DType ToDType(const at::Tensor& t, const char* name) {
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

// Rejects an output that shares memory with another argument. Where torch
// cannot tell (at::get_overlap_status answers TooHard for non-dense views),
// any overlap of the two byte ranges counts: a false alarm is an error
// message, a missed one a silently wrong result.
void CheckNoOverlap(const at::Tensor& out, const char* out_name,
                    const at::Tensor& other, const char* other_name) {
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

// [offset, offset + size) within [0, width), without overflow.
bool FitsIn(int64_t offset, int64_t size, int64_t width) {
  return offset >= 0 && size >= 0 && offset <= width && size <= width - offset;
}

// A 2-D floating-point CPU tensor whose rows are contiguous.
at::Tensor Matrix(const at::Tensor& t, const char* name) {
  CheckCpu(t, name);
  ToDType(t, name);
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got shape ", t.sizes());
  return t.stride(1) == 1 || t.size(1) <= 1 ? t : t.contiguous();
}

// Reads `count` integer values of a 1-D CPU index tensor, checking each lies
// in [lo, hi]. Nothing else is touched before all are checked.
IndexList ReadIndices(const at::Tensor& t, const char* name, int64_t count,
                      int64_t lo, int64_t hi, const char* range_note) {
  CheckCpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name,
              " must be an int64 or int32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.size(0) >= count, name, " has ", t.size(0),
              " entries, fewer than the ", count, " needed");
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

// Weights [L, rows, cols] (or [L, 1, rows, cols]) with a contiguous last
// dimension.
struct Weights {
  at::Tensor t;  // 3-D view, kept alive for the call.
  int64_t num_adapters, rows, cols;
};

Weights ViewWeights(const at::Tensor& w, const char* name) {
  CheckCpu(w, name);
  ToDType(w, name);
  TORCH_CHECK(w.dim() == 3 || (w.dim() == 4 && w.size(1) == 1), name,
              " must be [num_loras, rows, cols] or [num_loras, 1, rows, "
              "cols], got shape ",
              w.sizes());
  at::Tensor w3 = w.dim() == 4 ? w.select(1, 0) : w;
  if (w3.stride(2) != 1 && w3.size(2) > 1) w3 = w3.contiguous();
  return Weights{w3, w3.size(0), w3.size(1), w3.size(2)};
}

// ---------------------------------------------------------------- launch --

// One product over `groups`: columns [col0, col0 + n) of `out`.
struct Product {
  IsaChoice isa;   // Chosen before anything is written.
  at::Tensor x;    // [T, k]
  at::Tensor w;    // [L, >= n, k] (3-D, last dim contiguous)
  at::Tensor out;  // [T, >= col0 + n]
  int64_t col0 = 0;
  int64_t n = 0;
  float scale = 1.0f;
  bool add = false;
};

// Parallelise only above this many multiply-adds: thread start-up costs a few
// microseconds, which a smaller call would not win back.
constexpr int64_t kParallelMacs = int64_t{1} << 18;

int64_t ElementSize(DType t) { return t == DType::kFloat ? 4 : 2; }

// A shrink with fewer token blocks than threads, parallel over the
// reduction: part s runs `fn` over k elements [k0, k0 + kc) (kc a multiple of
// 32, as the bf16 pairs and AMX tiles want) into fp32 partial rows of its
// own, unscaled; the partials are then summed, scaled and added or stored
// into the real output, one rounding to its dtype as in the kernels.
void RunSplitK(const LoraArgs& a, KernelFn fn, c10::ArrayRef<WorkItem> items,
               c10::ArrayRef<Group> groups, c10::ArrayRef<int64_t> tokens,
               int64_t num_rows, int64_t n, int threads) {
  const int64_t kc = (a.k + 32 * threads - 1) / (32 * threads) * 32;
  const int64_t parts = (a.k + kc - 1) / kc;
  // Rows are indexed by token; only the groups' token rows are written and
  // read, so the buffer is left uninitialised.
  std::unique_ptr<float[]> partial(new float[parts * num_rows * n]);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      LoraArgs part = a;
      const int64_t k0 = s * kc;
      part.x = static_cast<const char*>(a.x) + k0 * ElementSize(a.x_dtype);
      part.w = static_cast<const char*>(a.w) + k0 * ElementSize(a.w_dtype);
      part.k = std::min(kc, a.k - k0);
      part.out = partial.get() + s * num_rows * n;
      part.out_row_stride = n;
      part.out_dtype = DType::kFloat;
      part.scale = 1.0f;
      part.add = false;
      fn(part, items.data(), 0, static_cast<int64_t>(items.size()));
    }
  });
  auto combine = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    for (const Group& g : groups) {
      for (int64_t i = 0; i < g.token_count; ++i) {
        const int64_t t = tokens[g.token_begin + i];
        T* row = out + t * a.out_row_stride;
        for (int64_t j = 0; j < n; ++j) {
          float sum = 0.0f;
          for (int64_t s = 0; s < parts; ++s) {
            sum += partial[(s * num_rows + t) * n + j];
          }
          float v = a.scale * sum;
          if (a.add) v += static_cast<float>(row[j]);
          row[j] = static_cast<T>(v);
        }
      }
    }
  };
  switch (a.out_dtype) {
    case DType::kFloat:
      combine(static_cast<float*>(a.out));
      break;
    case DType::kBFloat16:
      combine(static_cast<c10::BFloat16*>(a.out));
      break;
    case DType::kHalf:
      combine(static_cast<c10::Half*>(a.out));
      break;
  }
}

void Run(const Product& p, c10::ArrayRef<Group> groups,
         c10::ArrayRef<int64_t> tokens) {
  const int64_t k = p.x.size(1);
  if (groups.empty() || p.n == 0) return;
  if (k == 0) {
    // Empty reduction: the product is 0.
    for (const Group& g : groups) {
      for (int64_t i = 0; i < g.token_count; ++i) {
        auto row = p.out[tokens[g.token_begin + i]].narrow(0, p.col0, p.n);
        if (!p.add) row.zero_();
      }
    }
    return;
  }
  const IsaChoice& choice = p.isa;
  const IsaKernels& kernels = KernelsFor(choice.isa);
  const bool pack = k <= kMaxPackK && p.n > k;
  const KernelFn fn = pack ? kernels.pack : kernels.dot;

  LoraArgs a{};
  a.x = p.x.const_data_ptr();
  a.x_row_stride = p.x.stride(0);
  a.x_dtype = ToDType(p.x, "inputs");
  a.w = p.w.const_data_ptr();
  a.w_adapter_stride = p.w.stride(0);
  a.w_row_stride = p.w.stride(1);
  a.w_dtype = ToDType(p.w, "weights");
  a.out = static_cast<char*>(p.out.data_ptr()) +
          p.col0 * p.out.stride(1) * p.out.element_size();
  a.out_row_stride = p.out.stride(0);
  a.out_dtype = ToDType(p.out, "output");
  a.k = k;
  a.scale = p.scale;
  a.add = p.add;
  a.tokens = tokens.data();
  a.groups = groups.data();
  a.amx_min_tokens = AmxMinTokens(pack);
  a.amx_forced = choice.forced;

  int64_t total_tokens = 0;
  for (const Group& g : groups) total_tokens += g.token_count;
  const int64_t macs = total_tokens * p.n * k;
  const int threads = at::get_num_threads();
  const bool parallel =
      threads > 1 && macs >= kParallelMacs && !at::in_parallel_region();

  // Items of up to kMBlock tokens by n_block columns.
  constexpr int64_t kMBlock = 64;
  int64_t m_blocks = 0;
  for (const Group& g : groups)
    m_blocks += (g.token_count + kMBlock - 1) / kMBlock;
  // Expand items span as many columns as keep their packed weights (at
  // most 4k bytes a column) within about half of L2 while the item's token
  // tiles sweep them: each output row is then written in long runs, which
  // the hardware prefetchers follow (with 512 columns, 64 rows advanced in
  // 1 KB steps: a T=256 rank-8 expand into 11008 columns ran 1.4x slower).
  constexpr int64_t kAlign = 64;
  constexpr int64_t kPackBytes = int64_t{1} << 20;
  int64_t n_block = p.n;
  if (pack) {
    n_block = std::min(
        p.n, std::max<int64_t>(512, kPackBytes / (4 * k) / kAlign * kAlign));
  }
  if (parallel && pack) {
    // Expand: halve the column blocks until there are a few items per
    // thread.
    while (m_blocks * ((p.n + n_block - 1) / n_block) < 4 * threads &&
           n_block > kAlign) {
      n_block = std::max(kAlign, (n_block / 2 + kAlign - 1) / kAlign * kAlign);
    }
  }
  // Shrink keeps whole rows per item: split among threads, every part would
  // redo the per-token work (the AMX tiles interleave each token row once
  // per item) for a part of the few outputs. With fewer token blocks than
  // threads it splits the reduction instead (RunSplitK), except where the
  // kernels round fp32 inputs for a bf16 output (bgmv_impl.h), which the
  // fp32 partial rows would not.
  const bool rounds_x = a.x_dtype == DType::kFloat &&
                        a.w_dtype == DType::kBFloat16 &&
                        a.out_dtype == DType::kBFloat16;
  const bool split_k = parallel && !pack && m_blocks < threads && !rounds_x;
  c10::SmallVector<WorkItem, 32> items;
  items.reserve(m_blocks * ((p.n + n_block - 1) / n_block));
  for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi) {
    const int64_t count = groups[gi].token_count;
    for (int64_t m = 0; m < count; m += kMBlock) {
      for (int64_t n = 0; n < p.n; n += n_block) {
        items.push_back(WorkItem{gi, m, std::min(m + kMBlock, count), n,
                                 std::min(n + n_block, p.n)});
      }
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (split_k) {
    RunSplitK(a, fn, items, groups, tokens, p.x.size(0), p.n, threads);
  } else if (!parallel) {
    fn(a, items.data(), 0, num_items);
  } else {
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      fn(a, items.data(), begin, end);
    });
  }
}

// Groups tokens [0, count) by adapter (counting sort); -1 rows are skipped
// and returned in `no_lora`.
void GroupByAdapter(c10::ArrayRef<int64_t> indices, int64_t num_adapters,
                    GroupList* groups, IndexList* tokens, IndexList* no_lora) {
  const int64_t count = static_cast<int64_t>(indices.size());
  IndexList starts(num_adapters + 1, 0);
  for (int64_t i = 0; i < count; ++i) {
    if (indices[i] >= 0) ++starts[indices[i] + 1];
  }
  std::partial_sum(starts.begin(), starts.end(), starts.begin());
  tokens->assign(starts[num_adapters], 0);
  IndexList fill(starts.begin(), starts.end() - 1);
  for (int64_t i = 0; i < count; ++i) {
    if (indices[i] >= 0) {
      (*tokens)[fill[indices[i]]++] = i;
    } else {
      no_lora->push_back(i);
    }
  }
  for (int64_t a = 0; a < num_adapters; ++a) {
    if (starts[a + 1] > starts[a]) {
      groups->push_back(Group{a, starts[a], starts[a + 1] - starts[a]});
    }
  }
}

void ZeroRows(const at::Tensor& out, c10::ArrayRef<int64_t> rows,
              int64_t cols) {
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = out.stride(0) * out.element_size();
  for (int64_t r : rows) {
    std::memset(base + r * row_bytes, 0, cols * out.element_size());
  }
}

// Checks shared by every LoRA op. Returns the product with x, w and out set.
Product Prepare(const at::Tensor& inputs, const char* inputs_name,
                const at::Tensor& weights, const char* weights_name,
                const at::Tensor& output, const char* output_name,
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
  p.w = w->t;
  p.out = output;
  return p;
}

constexpr const char* kLoraRange = " (-1 means no LoRA)";

}  // namespace

// ------------------------------------------------------------------ ops --

void BgmvShrink(const at::Tensor& inputs, const at::Tensor& lora_a_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& lora_indices_tensor, double scaling) {
  Weights w;
  Product p = Prepare(inputs, "inputs", lora_a_weights, "lora_a_weights",
                      output_tensor, "output_tensor", lora_indices_tensor, &w);
  TORCH_CHECK(output_tensor.size(1) >= w.rows, "output_tensor has ",
              output_tensor.size(1), " columns, fewer than the rank ", w.rows,
              " of lora_a_weights");
  const auto indices =
      ReadIndices(lora_indices_tensor, "lora_indices_tensor", inputs.size(0),
                  -1, w.num_adapters - 1, kLoraRange);
  GroupList groups;
  IndexList tokens, no_lora;
  GroupByAdapter(indices, w.num_adapters, &groups, &tokens, &no_lora);
  p.n = w.rows;
  p.scale = static_cast<float>(scaling);
  ZeroRows(p.out, no_lora, p.n);
  Run(p, groups, tokens);
}

void BgmvExpandSlice(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                     const at::Tensor& output_tensor,
                     const at::Tensor& lora_indices_tensor,
                     int64_t slice_offset, int64_t slice_size,
                     bool add_inputs) {
  Weights w;
  Product p = Prepare(inputs, "inputs", lora_b_weights, "lora_b_weights",
                      output_tensor, "output_tensor", lora_indices_tensor, &w);
  TORCH_CHECK(FitsIn(slice_offset, slice_size, output_tensor.size(1)),
              "slice_offset ", slice_offset, " and slice_size ", slice_size,
              " do not fit in output_tensor of width ", output_tensor.size(1));
  const auto indices =
      ReadIndices(lora_indices_tensor, "lora_indices_tensor", inputs.size(0),
                  -1, w.num_adapters - 1, kLoraRange);
  GroupList groups;
  IndexList tokens, no_lora;
  GroupByAdapter(indices, w.num_adapters, &groups, &tokens, &no_lora);
  p.col0 = slice_offset;
  p.n = std::min(w.rows, slice_size);
  p.add = add_inputs;
  Run(p, groups, tokens);
}

void BgmvExpand(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& lora_indices_tensor, bool add_inputs) {
  TORCH_CHECK(output_tensor.dim() == 2, "output_tensor must be 2-D, got shape ",
              output_tensor.sizes());
  BgmvExpandSlice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0,
                  output_tensor.size(1), add_inputs);
}

namespace {

// Segments of an sgmv call: segment i is tokens [start, start + len) with
// adapter lora[i]. Checked in bounds and pairwise disjoint.
struct Segments {
  IndexList start, len, lora;
};

Segments ReadSegments(const at::Tensor& b_seq_start_loc,
                      const at::Tensor& seq_len_tensor,
                      const at::Tensor& lora_indices_tensor, int64_t batches,
                      int64_t num_tokens, int64_t num_adapters) {
  TORCH_CHECK(batches >= 0, "batches must be >= 0, got ", batches);
  for (const auto& [t, name] :
       {std::pair{&b_seq_start_loc, "b_seq_start_loc"},
        std::pair{&seq_len_tensor, "seq_len_tensor"},
        std::pair{&lora_indices_tensor, "lora_indices_tensor"}}) {
    TORCH_CHECK(t->dim() != 1 || t->size(0) >= batches, "batches (", batches,
                ") exceeds the ", t->size(0), " entries of ", name);
  }
  Segments s;
  s.start = ReadIndices(b_seq_start_loc, "b_seq_start_loc", batches, 0,
                        num_tokens, " (token positions)");
  s.len = ReadIndices(seq_len_tensor, "seq_len_tensor", batches, 0, num_tokens,
                      " (segment lengths)");
  s.lora = ReadIndices(lora_indices_tensor, "lora_indices_tensor", batches, -1,
                       num_adapters - 1, kLoraRange);
  std::vector<int64_t> order(batches);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return s.start[a] < s.start[b]; });
  int64_t prev = -1;
  for (int64_t i : order) {
    TORCH_CHECK(s.start[i] + s.len[i] <= num_tokens, "segment ", i,
                " (b_seq_start_loc ", s.start[i], ", seq_len_tensor ", s.len[i],
                ") runs past the ", num_tokens, " input tokens");
    if (s.len[i] == 0) continue;
    TORCH_CHECK(prev < 0 || s.start[i] >= s.start[prev] + s.len[prev],
                "segments ", prev, " and ", i,
                " overlap (b_seq_start_loc / seq_len_tensor)");
    prev = i;
  }
  return s;
}

// Segment groups: the segments of one adapter form one group, their token
// ranges one after another, so each adapter's weights are read once per call
// however its tokens are split. (vLLM's CPU runner also sends decode steps
// through sgmv, one single-token segment per request.)
void SegmentGroups(const Segments& s, int64_t num_adapters, GroupList* groups,
                   IndexList* tokens, IndexList* no_lora) {
  IndexList starts(num_adapters + 1, 0);
  for (size_t i = 0; i < s.start.size(); ++i) {
    if (s.lora[i] >= 0) {
      starts[s.lora[i] + 1] += s.len[i];
    } else {
      for (int64_t t = 0; t < s.len[i]; ++t) no_lora->push_back(s.start[i] + t);
    }
  }
  std::partial_sum(starts.begin(), starts.end(), starts.begin());
  tokens->assign(starts[num_adapters], 0);
  IndexList fill(starts.begin(), starts.end() - 1);
  for (size_t i = 0; i < s.start.size(); ++i) {
    if (s.lora[i] < 0) continue;
    int64_t* dst = tokens->data() + fill[s.lora[i]];
    std::iota(dst, dst + s.len[i], s.start[i]);
    fill[s.lora[i]] += s.len[i];
  }
  for (int64_t a = 0; a < num_adapters; ++a) {
    if (starts[a + 1] > starts[a]) {
      groups->push_back(Group{a, starts[a], starts[a + 1] - starts[a]});
    }
  }
}

void SgmvShrink(const at::Tensor& inputs, const at::Tensor& lora_a_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& b_seq_start_loc,
                const at::Tensor& seq_len_tensor,
                const at::Tensor& lora_indices_tensor, int64_t batches,
                int64_t max_seq_length, int64_t token_nums, double scaling) {
  (void)max_seq_length;  // Hints only: the segments are read and checked.
  (void)token_nums;
  Weights w;
  Product p = Prepare(inputs, "inputs", lora_a_weights, "lora_a_weights",
                      output_tensor, "output_tensor", lora_indices_tensor, &w);
  TORCH_CHECK(output_tensor.size(1) >= w.rows, "output_tensor has ",
              output_tensor.size(1), " columns, fewer than the rank ", w.rows,
              " of lora_a_weights");
  const Segments s =
      ReadSegments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                   batches, inputs.size(0), w.num_adapters);
  GroupList groups;
  IndexList tokens, no_lora;
  SegmentGroups(s, w.num_adapters, &groups, &tokens, &no_lora);
  p.n = w.rows;
  p.scale = static_cast<float>(scaling);
  ZeroRows(p.out, no_lora, p.n);
  Run(p, groups, tokens);
}

void SgmvExpandSlice(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                     const at::Tensor& output_tensor,
                     const at::Tensor& b_seq_start_loc,
                     const at::Tensor& seq_len_tensor,
                     const at::Tensor& lora_indices_tensor, int64_t batches,
                     int64_t max_seq_length, int64_t token_nums,
                     int64_t slice_offset, int64_t slice_size,
                     bool add_inputs) {
  (void)max_seq_length;
  (void)token_nums;
  Weights w;
  Product p = Prepare(inputs, "inputs", lora_b_weights, "lora_b_weights",
                      output_tensor, "output_tensor", lora_indices_tensor, &w);
  TORCH_CHECK(FitsIn(slice_offset, slice_size, output_tensor.size(1)),
              "slice_offset ", slice_offset, " and slice_size ", slice_size,
              " do not fit in output_tensor of width ", output_tensor.size(1));
  const Segments s =
      ReadSegments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                   batches, inputs.size(0), w.num_adapters);
  GroupList groups;
  IndexList tokens, no_lora;
  SegmentGroups(s, w.num_adapters, &groups, &tokens, &no_lora);
  p.col0 = slice_offset;
  p.n = std::min(w.rows, slice_size);
  p.add = add_inputs;
  Run(p, groups, tokens);
}

void SgmvExpand(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& b_seq_start_loc,
                const at::Tensor& seq_len_tensor,
                const at::Tensor& lora_indices_tensor, int64_t batches,
                int64_t max_seq_length, int64_t token_nums, bool add_inputs) {
  TORCH_CHECK(output_tensor.dim() == 2, "output_tensor must be 2-D, got shape ",
              output_tensor.sizes());
  SgmvExpandSlice(inputs, lora_b_weights, output_tensor, b_seq_start_loc,
                  seq_len_tensor, lora_indices_tensor, batches, max_seq_length,
                  token_nums, 0, output_tensor.size(1), add_inputs);
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
  auto indices = ReadIndices(indicies, "indicies", x.size(0),
                             std::numeric_limits<int64_t>::min(),
                             wv.num_adapters - 1, " (negative skips the row)");
  for (int64_t& i : indices) i = std::max<int64_t>(i, -1);
  GroupList groups;
  IndexList tokens, no_lora;
  GroupByAdapter(indices, wv.num_adapters, &groups, &tokens, &no_lora);
  p.col0 = y_offset;
  p.n = h_out;
  p.scale = static_cast<float>(scale);
  p.add = true;
  Run(p, groups, tokens);
}

void DispatchBgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& indicies, int64_t layer_idx, double scale) {
  TORCH_CHECK(w.dim() == 4,
              "w must be [num_loras, num_layers, h_out, h_in], got shape ",
              w.sizes());
  DispatchBgmvLowLevel(y, x, w, indicies, layer_idx, scale, w.size(3),
                       w.size(2), 0);
}

std::string IsaName() { return kIsaNames[static_cast<int>(SelectIsa().isa)]; }

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
