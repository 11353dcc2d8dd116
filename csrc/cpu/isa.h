// The ISA paths: which ones this CPU supports, which one a call takes (the
// best, or the one VLLM_CPU_LORA_ISA forces), and their kernel tables.
#pragma once

#include <string>
#include <vector>

#include "kernel_interface.h"

namespace vllm_cpu_lora {

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

struct IsaChoice {
  Isa isa;
  bool forced;  // By VLLM_CPU_LORA_ISA.
};

// The best ISA of this CPU, or the one VLLM_CPU_LORA_ISA forces (an error if
// unknown or unsupported). The variable is read on every call (a getenv is
// ~100 ns), so tests can switch paths.
IsaChoice SelectIsa();

// Supported paths, best first, the test-only emulation last.
std::vector<std::string> SupportedIsas();

// The name of the path SelectIsa() takes, e.g. "avx512_bf16".
std::string IsaName();

const IsaKernels& KernelsFor(Isa isa);

}  // namespace vllm_cpu_lora
