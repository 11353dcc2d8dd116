# ruff: noqa: N999  (the name is the extension's, fixed by setup.py)
# Stub of the C++ extension module (csrc/cpu/py_module.cpp): importing it
# registers torch.ops.vllm_cpu_lora; these are its eager fast path for the
# decode and multi-slice ops (vllm_cpu_lora/ops.py), taking the arguments
# of the ops.py function of the same name without `eager_`: inputs,
# weights (a list for the multi-slice ops), output, indices, then the op's
# scalars. Each runs the CPU kernel and returns True,
# or returns False, having done nothing, when torch.ops must dispatch the
# call. Positional arguments only (METH_FASTCALL).

from torch import Tensor

def eager_bgmv_shrink(
    x: Tensor, w: Tensor, y: Tensor, indices: Tensor, scaling: float, /
) -> bool: ...
def eager_bgmv_expand(
    x: Tensor, w: Tensor, y: Tensor, indices: Tensor, add_inputs: bool, /
) -> bool: ...
def eager_bgmv_expand_slice(
    x: Tensor,
    w: Tensor,
    y: Tensor,
    indices: Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool,
    /,
) -> bool: ...
def eager_lora_shrink(
    x: Tensor, w: list[Tensor], y: Tensor, indices: Tensor, scaling: float, /
) -> bool: ...
def eager_lora_expand(
    x: Tensor,
    w: list[Tensor],
    y: Tensor,
    indices: Tensor,
    offset_start: int,
    add_inputs: bool,
    /,
) -> bool: ...

# Calls of each torch.ops.vllm_cpu_lora op in this process, counted by the
# C++ ops themselves (so compiled graphs' calls count too); ops never called
# are left out.
def call_counts() -> dict[str, int]: ...
def reset_call_counts() -> None: ...
