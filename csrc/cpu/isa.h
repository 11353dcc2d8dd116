// The ISA paths: which ones this CPU supports, which one a call takes (the
// best, or the one VLLM_CPU_LORA_ISA forces), and their kernel tables.
#pragma once

#include <string>
#include <vector>

#include "kernel_interface.h"

namespace vllm_cpu_lora {

// This architecture's paths in order of preference, up to kBest; the ones
// after it (kAmxEmulated, test-only) are never chosen unless forced.
#if defined(__x86_64__)
enum class Isa : int {
  kScalar,
  kAvx2,
  kAvx512,
  kAvx512Bf16,
  kAmx,
  kAmxEmulated,
  kCount,
  kBest = kAmx
};
#elif defined(__aarch64__)
enum class Isa : int { kScalar, kNeon, kNeonBf16, kCount, kBest = kNeonBf16 };
#else
enum class Isa : int { kScalar, kCount, kBest = kScalar };
#endif

struct IsaChoice {
  Isa isa;
  bool forced;  // By VLLM_CPU_LORA_ISA.
};

// The best ISA of this CPU, or the one VLLM_CPU_LORA_ISA forces (an error if
// unknown or unsupported). The variable is read on every call (a getenv is
// ~100 ns), so tests can switch paths.
IsaChoice SelectIsa();

// The paths this build has kernels for (all of this architecture's, unless
// VLLM_CPU_LORA_BUILD_ISAS chose fewer), best first, test-only ones last.
std::vector<std::string> BuiltIsas();

// Supported paths (built, and run by this CPU), best first, the test-only
// emulation last.
std::vector<std::string> SupportedIsas();

// The name of the path SelectIsa() takes, e.g. "avx512_bf16" or "neon".
std::string IsaName();

const IsaKernels& KernelsFor(Isa isa);

}  // namespace vllm_cpu_lora
