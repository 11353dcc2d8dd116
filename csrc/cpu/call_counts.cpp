#include "call_counts.h"

#include <array>
#include <atomic>

namespace vllm_cpu_lora {
namespace {

constexpr int kNumOps = static_cast<int>(OpName::kNumOps);

// Relaxed: the counts order nothing, and ops run from many threads at once.
std::array<std::atomic<int64_t>, kNumOps> counts{};

}  // namespace

const char* OpNameString(OpName op) {
  static constexpr std::array<const char*, kNumOps> kNames = {
      "bgmv_shrink",       "bgmv_expand",
      "bgmv_expand_slice", "sgmv_shrink",
      "sgmv_expand",       "sgmv_expand_slice",
      "lora_shrink",       "lora_expand",
      "dispatch_bgmv",     "dispatch_bgmv_low_level"};
  return kNames[static_cast<int>(op)];
}

void CountCall(OpName op) {
  counts[static_cast<int>(op)].fetch_add(1, std::memory_order_relaxed);
}

int64_t CallCount(OpName op) {
  return counts[static_cast<int>(op)].load(std::memory_order_relaxed);
}

void ResetCallCounts() {
  for (auto& c : counts) c.store(0, std::memory_order_relaxed);
}

}  // namespace vllm_cpu_lora
