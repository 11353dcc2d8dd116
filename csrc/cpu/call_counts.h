// Per-process counts of the ops' calls, read by the vLLM plug-in's worker
// report: in a compiled model the ops are called from the graph, with no
// Python of this package in between to count them.
#pragma once

#include <cstdint>

namespace vllm_cpu_lora {

enum class OpName {
  kBgmvShrink,
  kBgmvExpand,
  kBgmvExpandSlice,
  kSgmvShrink,
  kSgmvExpand,
  kSgmvExpandSlice,
  kLoraShrink,
  kLoraExpand,
  kDispatchBgmv,
  kDispatchBgmvLowLevel,
  kNumOps,
};

// The op's schema name, e.g. "bgmv_shrink".
const char* OpNameString(OpName op);

void CountCall(OpName op);

int64_t CallCount(OpName op);

void ResetCallCounts();

}  // namespace vllm_cpu_lora
