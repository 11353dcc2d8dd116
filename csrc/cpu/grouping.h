// Token grouping: the tokens of a call, sorted by adapter into groups, so
// that each adapter's weights are streamed once per call for all of them.
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <cstdint>

#include "kernel_interface.h"

namespace vllm_cpu_lora {

// Per-call lists with inline storage sized for decode batches, so a small
// call makes no heap allocation (each is tens of nanoseconds of a ~0.5 us
// call); larger ones spill to the heap.
using IndexList = c10::SmallVector<int64_t, 64>;
using GroupList = c10::SmallVector<Group, 16>;

// The segments of an sgmv call: segment i is tokens [start[i], start[i] +
// len[i]) with adapter lora[i] (-1: none).
struct Segments {
  IndexList start, len, lora;
};

// The tokens, grouped: `groups` in adapter order, each a run of `tokens`;
// `no_lora` the tokens whose adapter is -1.
struct Grouping {
  GroupList groups;
  IndexList tokens;
  IndexList no_lora;
};

// Token i has adapter indices[i].
Grouping GroupByAdapter(c10::ArrayRef<int64_t> indices, int64_t num_adapters);

// The segments of one adapter form one group, their tokens one after another,
// however the adapter's tokens are split (vLLM's CPU runner also sends decode
// steps through sgmv, one single-token segment per request).
Grouping GroupSegments(const Segments& s, int64_t num_adapters);

}  // namespace vllm_cpu_lora
