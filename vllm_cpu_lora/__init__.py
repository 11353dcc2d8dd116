"""Fast multi-LoRA kernels for vLLM on CPUs.

`vllm_cpu_lora.ops` holds drop-ins for `vllm.lora.ops.torch_ops` (CPU tensors
run the C++ kernels of `torch.ops.vllm_cpu_lora`, others the pure-torch
`vllm_cpu_lora.reference`).
"""

import torch

from vllm_cpu_lora import (
    _C,  # noqa: F401  (registers torch.ops.vllm_cpu_lora)
    ops,
    reference,
)

__all__ = ["built_isas", "isa", "ops", "reference", "supported_isas"]


def isa() -> str:
    """The ISA path the C++ ops use now: the best this CPU supports, or the
    one `VLLM_CPU_LORA_ISA` forces (an error if the CPU lacks it)."""
    return torch.ops.vllm_cpu_lora.isa()


def built_isas() -> list[str]:
    """Every ISA path this build has kernels for, best first: all of the
    architecture's unless `VLLM_CPU_LORA_BUILD_ISAS` chose fewer at build
    time (build_isas.py)."""
    return list(torch.ops.vllm_cpu_lora.built_isas())


def supported_isas() -> list[str]:
    """Every ISA path this build has and this CPU can run, best first; the
    last entry, "amx_emulated" (the AMX kernel on software-emulated tiles,
    test-only and slow), appears wherever AVX512-BF16 does and is never
    chosen unless forced."""
    return list(torch.ops.vllm_cpu_lora.supported_isas())
