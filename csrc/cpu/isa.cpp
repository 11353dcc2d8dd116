#include "isa.h"

#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>

#include <cstdlib>

namespace vllm_cpu_lora {
namespace {

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

std::string SupportedList() {
  std::string list;
  for (const std::string& name : SupportedIsas()) {
    list += (list.empty() ? "" : ", ") + name;
  }
  return list;
}

}  // namespace

std::vector<std::string> SupportedIsas() {
  std::vector<std::string> names;
  for (int i = static_cast<int>(Isa::kAmx); i >= 0; --i) {
    if (IsSupported(static_cast<Isa>(i))) names.push_back(kIsaNames[i]);
  }
  if (IsSupported(Isa::kAmxEmulated)) names.push_back("amx_emulated");
  return names;
}

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

std::string IsaName() { return kIsaNames[static_cast<int>(SelectIsa().isa)]; }

}  // namespace vllm_cpu_lora
