# ruff: noqa: N999  (the name is the extension's, fixed by setup.py)
# Stub of the C++ extension module (csrc/cpu/py_module.cpp): importing it
# registers torch.ops.vllm_cpu_lora; these are its eager fast path for the
# decode ops (vllm_cpu_lora/ops.py). Each runs the CPU kernel and returns True,
# or returns False, having done nothing, when torch.ops must dispatch the call.
# Positional arguments only (METH_FASTCALL).

import torch

def eager_bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float,
    /,
) -> bool: ...
def eager_bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool,
    /,
) -> bool: ...
def eager_bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool,
    /,
) -> bool: ...
