// The kernel headers put their code in namespace
// vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS. Each kernels_<isa>.cpp defines the
// macro as its path's name before including them, so every ISA gets its own
// copy of every function: nothing compiled for one ISA's target can be
// linked into another ISA's path.
#pragma once

#ifndef VLLM_CPU_LORA_ISA_NS
#ifdef __clang__  // clangd or an IDE reading a header on its own.
#define VLLM_CPU_LORA_ISA_NS unspecified
#else
#error \
    "define VLLM_CPU_LORA_ISA_NS before the kernel headers (kernels_<isa>.cpp)"
#endif
#endif
