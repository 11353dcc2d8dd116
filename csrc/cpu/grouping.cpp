#include "grouping.h"

#include <numeric>

namespace vllm_cpu_lora {
namespace {

// One counting sort for both op families: run i (of num_runs) is
// run_at(i) = {adapter, first token, token count}.
struct Run {
  int64_t adapter, start, len;
};

template <class RunAt>
Grouping GroupRuns(int64_t num_runs, int64_t num_adapters, RunAt run_at) {
  Grouping g;
  IndexList starts(num_adapters + 1, 0);
  for (int64_t i = 0; i < num_runs; ++i) {
    const Run r = run_at(i);
    if (r.adapter >= 0) {
      starts[r.adapter + 1] += r.len;
    } else {
      for (int64_t t = 0; t < r.len; ++t) g.no_lora.push_back(r.start + t);
    }
  }
  std::partial_sum(starts.begin(), starts.end(), starts.begin());
  g.tokens.resize_for_overwrite(starts[num_adapters]);
  IndexList fill(starts.begin(), starts.end() - 1);
  for (int64_t i = 0; i < num_runs; ++i) {
    const Run r = run_at(i);
    if (r.adapter < 0) continue;
    int64_t* dst = g.tokens.data() + fill[r.adapter];
    std::iota(dst, dst + r.len, r.start);
    fill[r.adapter] += r.len;
  }
  for (int64_t a = 0; a < num_adapters; ++a) {
    if (starts[a + 1] > starts[a]) {
      g.groups.push_back(Group{a, starts[a], starts[a + 1] - starts[a]});
    }
  }
  return g;
}

}  // namespace

Grouping GroupByAdapter(c10::ArrayRef<int64_t> indices, int64_t num_adapters) {
  return GroupRuns(static_cast<int64_t>(indices.size()), num_adapters,
                   [&](int64_t i) {
                     return Run{indices[i], i, 1};
                   });
}

Grouping GroupSegments(const Segments& s, int64_t num_adapters) {
  return GroupRuns(static_cast<int64_t>(s.start.size()), num_adapters,
                   [&](int64_t i) {
                     return Run{s.lora[i], s.start[i], s.len[i]};
                   });
}

}  // namespace vllm_cpu_lora
