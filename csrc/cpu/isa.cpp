#include "isa.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <iterator>

#if defined(__x86_64__)
#include <ATen/cpu/Utils.h>
#elif defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
// For kernel headers older than FEAT_BF16 (Linux 5.10's value).
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
#endif

namespace vllm_cpu_lora {
namespace {

#if defined(__x86_64__)
constexpr const char* kIsaNames[] = {"scalar",      "avx2", "avx512",
                                     "avx512_bf16", "amx",  "amx_emulated"};
#elif defined(__aarch64__)
constexpr const char* kIsaNames[] = {"scalar", "neon", "neon_bf16"};
#else
constexpr const char* kIsaNames[] = {"scalar"};
#endif
static_assert(std::size(kIsaNames) == static_cast<size_t>(Isa::kCount));

struct CpuFeatures {
  bool supported[static_cast<int>(Isa::kCount)];
};

const CpuFeatures& Features() {
  static const CpuFeatures features = [] {
    CpuFeatures f{};
    f.supported[static_cast<int>(Isa::kScalar)] = true;
#if defined(__x86_64__)
    const auto caps = at::cpu::get_cpu_capabilities();
    auto has = [&](const char* key) {
      const auto it = caps.find(key);
      return it != caps.end() && it->second.isBool() && it->second.toBool();
    };
    const bool avx2 = has("avx2") && has("fma3") && has("f16c");
    const bool avx512 = avx2 && has("avx512_f") && has("avx512_bw") &&
                        has("avx512_vl") && has("avx512_dq");
    f.supported[static_cast<int>(Isa::kAvx2)] = avx2;
    f.supported[static_cast<int>(Isa::kAvx512)] = avx512;
    const bool avx512_bf16 = avx512 && has("avx512_bf16");
    f.supported[static_cast<int>(Isa::kAvx512Bf16)] = avx512_bf16;
    // AMX also needs the OS to grant tile state (arch_prctl, via torch).
    f.supported[static_cast<int>(Isa::kAmx)] = avx512_bf16 && has("amx_bf16") &&
                                               has("amx_tile") &&
                                               at::cpu::init_amx();
    f.supported[static_cast<int>(Isa::kAmxEmulated)] = avx512_bf16;
#elif defined(__aarch64__)
    // What Linux says this CPU (or qemu's -cpu model) implements.
    const bool neon = (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
    f.supported[static_cast<int>(Isa::kNeon)] = neon;
    f.supported[static_cast<int>(Isa::kNeonBf16)] =
        neon && (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0;
#endif
    return f;
  }();
  return features;
}

// The kernels of a path this build lacks (its weak accessor is null) are null.
IsaKernels KernelsIfBuilt(IsaKernels (*kernels)()) {
  return kernels != nullptr ? kernels() : IsaKernels{};
}

// Whether this build has the path's kernels (build_isas.py).
bool IsBuilt(Isa isa) {
  const IsaKernels& kernels = KernelsFor(isa);
  return kernels.dot != nullptr && kernels.pack != nullptr;
}

bool IsSupported(Isa isa) {
  return IsBuilt(isa) && Features().supported[static_cast<int>(isa)];
}

// Every path of this architecture: best first, the test-only ones last.
std::vector<Isa> AllIsas() {
  std::vector<Isa> order;
  for (int i = static_cast<int>(Isa::kBest); i >= 0; --i) {
    order.push_back(static_cast<Isa>(i));
  }
  for (int i = static_cast<int>(Isa::kBest) + 1;
       i < static_cast<int>(Isa::kCount); ++i) {
    order.push_back(static_cast<Isa>(i));
  }
  return order;
}

std::string Join(const std::vector<std::string>& names) {
  std::string list;
  for (const std::string& name : names) {
    list += (list.empty() ? "" : ", ") + name;
  }
  return list;
}

}  // namespace

std::vector<std::string> BuiltIsas() {
  std::vector<std::string> names;
  for (const Isa isa : AllIsas()) {
    if (IsBuilt(isa)) names.push_back(kIsaNames[static_cast<int>(isa)]);
  }
  return names;
}

std::vector<std::string> SupportedIsas() {
  std::vector<std::string> names;
  for (const Isa isa : AllIsas()) {
    if (IsSupported(isa)) names.push_back(kIsaNames[static_cast<int>(isa)]);
  }
  return names;
}

IsaChoice SelectIsa() {
  const char* forced = std::getenv("VLLM_CPU_LORA_ISA");
  if (forced != nullptr && *forced != '\0') {
    for (int i = 0; i < static_cast<int>(Isa::kCount); ++i) {
      if (std::string(forced) != kIsaNames[i]) continue;
      TORCH_CHECK(IsBuilt(static_cast<Isa>(i)), "VLLM_CPU_LORA_ISA=", forced,
                  " is not built into this install (built: ", Join(BuiltIsas()),
                  "); VLLM_CPU_LORA_BUILD_ISAS chose the paths at build time");
      TORCH_CHECK(
          IsSupported(static_cast<Isa>(i)), "VLLM_CPU_LORA_ISA=", forced,
          " is not supported by this CPU (supported: ", Join(SupportedIsas()),
          ")");
      return IsaChoice{static_cast<Isa>(i), true};
    }
    std::vector<std::string> known;
    for (const Isa isa : AllIsas()) {
      known.push_back(kIsaNames[static_cast<int>(isa)]);
    }
    TORCH_CHECK(false, "VLLM_CPU_LORA_ISA=", forced,
                " is not a known ISA path (known: ", Join(known),
                "; supported here: ", Join(SupportedIsas()), ")");
  }
  for (int i = static_cast<int>(Isa::kBest); i > 0; --i) {
    if (IsSupported(static_cast<Isa>(i))) {
      return IsaChoice{static_cast<Isa>(i), false};
    }
  }
  return IsaChoice{Isa::kScalar, false};
}

const IsaKernels& KernelsFor(Isa isa) {
  static const IsaKernels table[] = {
    scalar::Kernels(),
#if defined(__x86_64__)
    KernelsIfBuilt(&avx2::Kernels),
    KernelsIfBuilt(&avx512::Kernels),
    KernelsIfBuilt(&avx512_bf16::Kernels),
    KernelsIfBuilt(&amx::Kernels),
    KernelsIfBuilt(&amx_emulated::Kernels),
#elif defined(__aarch64__)
    KernelsIfBuilt(&neon::Kernels),
    KernelsIfBuilt(&neon_bf16::Kernels),
#endif
  };
  static_assert(std::size(table) == static_cast<size_t>(Isa::kCount));
  return table[static_cast<int>(isa)];
}

std::string IsaName() { return kIsaNames[static_cast<int>(SelectIsa().isa)]; }

}  // namespace vllm_cpu_lora
