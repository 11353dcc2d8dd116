#include "launch.h"

#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#include "checks.h"
#include "grouping.h"
#include "tuning.h"

namespace vllm_cpu_lora {
namespace {

int64_t ElementSize(DType t) { return t == DType::kFloat ? 4 : 2; }

// Where column col0 of out's first row lies.
char* ColumnStart(const at::Tensor& out, int64_t col0) {
  return static_cast<char*>(out.data_ptr()) +
         col0 * out.stride(1) * out.element_size();
}

// Half of a core's L2: where an expand item's packed weights should fit.
int64_t PackedBytesPerItem() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // NOLINT(runtime/int)
    return (l2 > 0 ? int64_t{l2} : kFallbackL2Bytes) / 2;
  }();
  return bytes;
}

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

// Whether all k elements of a row are zeros (of either sign).
template <class T>
bool IsZeroRow(const void* row, int64_t k) {
  const T* values = static_cast<const T*>(row);
  return std::all_of(values, values + k,
                     [](T v) { return static_cast<float>(v) == 0.0f; });
}

// The groups with an input row that is not all zeros. The others' products
// are zeros (whatever the weights): an accumulating product leaves their
// rows as they are, a storing one zeroes them. vLLM zeroes the slots of
// adapters without a module, so for them the expands read no weights. A
// non-zero row usually ends the scan at its first element.
GroupList GroupsWithInputs(const Product& p, c10::ArrayRef<Group> groups,
                           c10::ArrayRef<int64_t> tokens) {
  const DType dtype = ToDType(*p.x, "inputs");
  const char* x = static_cast<const char*>(p.x->const_data_ptr());
  const int64_t row_bytes = p.x->stride(0) * p.x->element_size();
  const int64_t k = p.x->size(1);
  GroupList live;
  for (const Group& g : groups) {
    const c10::ArrayRef<int64_t> rows =
        tokens.slice(g.token_begin, g.token_count);
    // k = 0, an empty reduction, is a zero product too.
    const bool zero =
        k == 0 || std::all_of(rows.begin(), rows.end(), [&](int64_t t) {
          const char* row = x + t * row_bytes;
          switch (dtype) {
            case DType::kFloat:
              return IsZeroRow<float>(row, k);
            case DType::kBFloat16:
              return IsZeroRow<c10::BFloat16>(row, k);
            case DType::kHalf:
              return IsZeroRow<c10::Half>(row, k);
          }
          return false;
        });
    if (!zero) {
      live.push_back(g);
    } else if (!p.add) {
      ZeroRows(*p.out, rows, p.col0, p.n);
    }
  }
  return live;
}

}  // namespace

void Run(const Product& p, c10::ArrayRef<Group> all_groups,
         c10::ArrayRef<int64_t> tokens) {
  if (all_groups.empty() || p.n == 0) return;
  const GroupList live = GroupsWithInputs(p, all_groups, tokens);
  const c10::ArrayRef<Group> groups = live;
  if (groups.empty()) return;
  const int64_t k = p.x->size(1);
  const IsaChoice& choice = p.isa;
  const IsaKernels& kernels = KernelsFor(choice.isa);
  const bool pack = k <= kMaxPackK && p.n > k;
  const KernelFn fn = pack ? kernels.pack : kernels.dot;

  LoraArgs a{};
  a.x = p.x->const_data_ptr();
  a.x_row_stride = p.x->stride(0);
  a.x_dtype = ToDType(*p.x, "inputs");
  a.w = p.w->const_data_ptr();
  a.w_adapter_stride = p.w->stride(0);
  a.w_row_stride = p.w->stride(1);
  a.w_dtype = ToDType(*p.w, "weights");
  a.out = ColumnStart(*p.out, p.col0);
  a.out_row_stride = p.out->stride(0);
  a.out_dtype = ToDType(*p.out, "output");
  a.k = k;
  a.scale = p.scale;
  a.add = p.add;
  a.tokens = tokens.data();
  a.groups = groups.data();
  a.amx_forced = choice.forced;

  int64_t total_tokens = 0;
  for (const Group& g : groups) total_tokens += g.token_count;
  // The call's size as kParallelMacs measures it.
  int64_t macs = total_tokens * p.n * k;
  if (pack && !kernels.bf16_pairs)
    macs += kExpandOutputMacs * total_tokens * p.n;
  const int threads = at::get_num_threads();
  const bool parallel =
      threads > 1 && macs >= kParallelMacs && !at::in_parallel_region();

  // Items of up to kWorkItemTokens tokens by n_block columns.
  int64_t m_blocks = 0;
  for (const Group& g : groups) {
    m_blocks += (g.token_count + kWorkItemTokens - 1) / kWorkItemTokens;
  }
  int64_t n_block = p.n;
  if (pack) {
    // At most 4k bytes of packed weights a column.
    n_block = std::min(
        p.n, std::max(kMinColumnsPerItem, PackedBytesPerItem() / (4 * k) /
                                              kColumnAlign * kColumnAlign));
  }
  // Expand: with enough tokens each thread takes an equal share of them,
  // whole output rows; else an equal share of the outputs (tokens x
  // columns), cut between whole cache lines of columns.
  const bool split_tokens =
      parallel && pack &&
      total_tokens >= kernels.split_tokens_per_thread * threads;
  const bool split_columns = parallel && pack && !split_tokens;
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
  // A thread's share may cut a token block or a column block in two.
  items.reserve((m_blocks + (split_tokens || split_columns ? threads : 0)) *
                ((p.n + n_block - 1) / n_block));
  // Items of group gi's tokens [m0, m1) and columns [n0, n1). Token blocks
  // innermost: consecutive items of a column block share its packed weights
  // (PackedBlocks).
  auto add_items = [&](int64_t gi, int64_t m0, int64_t m1, int64_t n0,
                       int64_t n1) {
    for (int64_t n = n0; n < n1; n += n_block) {
      for (int64_t m = m0; m < m1; m += kWorkItemTokens) {
        items.push_back(WorkItem{gi, m, std::min(m + kWorkItemTokens, m1), n,
                                 std::min(n + n_block, n1)});
      }
    }
  };
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  // Thread j's items are [thread_items[j], thread_items[j+1]). split_tokens:
  // tokens [j * total / threads, (j + 1) * total / threads) of the groups'
  // tokens in order (never empty: each holds split_tokens_per_thread or
  // more). split_columns: the same share of the groups' outputs in order,
  // group by group, each group's columns in order.
  c10::SmallVector<int64_t, 16> thread_items;
  if (split_tokens) {
    thread_items.push_back(0);
    int64_t first = 0;  // Group gi's first token in that order.
    for (int64_t gi = 0; gi < num_groups; ++gi) {
      const int64_t count = groups[gi].token_count;
      for (int64_t m = 0; m < count;) {
        const int64_t j = static_cast<int64_t>(thread_items.size()) - 1;
        const int64_t share_end = (j + 1) * total_tokens / threads;
        const int64_t m1 = std::min(count, share_end - first);
        add_items(gi, m, m1, 0, p.n);
        m = m1;
        if (first + m == share_end) {
          thread_items.push_back(static_cast<int64_t>(items.size()));
        }
      }
      first += count;
    }
  } else if (split_columns) {
    thread_items.push_back(0);
    const int64_t outputs = total_tokens * p.n;
    int64_t first = 0;  // Group gi's first output in that order.
    for (int64_t gi = 0; gi < num_groups; ++gi) {
      const int64_t count = groups[gi].token_count;
      int64_t n0 = 0;
      // The shares ending within this group cut its columns.
      for (int64_t j = static_cast<int64_t>(thread_items.size()); j < threads;
           ++j) {
        const int64_t share_end = j * outputs / threads;
        const int64_t before = share_end - first;
        const int64_t after = first + count * p.n - share_end;
        if (after <= 0) break;
        int64_t cut =
            (before / count + kColumnAlign / 2) / kColumnAlign * kColumnAlign;
        if (ShareEndsAtEdge(before, after)) cut = 0;
        if (ShareEndsAtEdge(after, before)) cut = p.n;
        const int64_t n1 = std::clamp(cut, n0, p.n);
        add_items(gi, 0, count, n0, n1);
        n0 = n1;
        thread_items.push_back(static_cast<int64_t>(items.size()));
      }
      add_items(gi, 0, count, n0, p.n);
      first += count * p.n;
    }
    thread_items.push_back(static_cast<int64_t>(items.size()));
  } else {
    for (int64_t gi = 0; gi < num_groups; ++gi) {
      add_items(gi, 0, groups[gi].token_count, 0, p.n);
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (split_k) {
    RunSplitK(a, fn, items, groups, tokens, p.x->size(0), p.n, threads);
  } else if (!parallel) {
    fn(a, items.data(), 0, num_items);
  } else if (split_tokens || split_columns) {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        fn(a, items.data(), thread_items[j], thread_items[j + 1]);
      }
    });
  } else {
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      fn(a, items.data(), begin, end);
    });
  }
}

void ZeroRows(const at::Tensor& out, c10::ArrayRef<int64_t> rows, int64_t col0,
              int64_t cols) {
  char* base = ColumnStart(out, col0);
  const int64_t row_bytes = out.stride(0) * out.element_size();
  for (int64_t r : rows) {
    std::memset(base + r * row_bytes, 0, cols * out.element_size());
  }
}

}  // namespace vllm_cpu_lora
