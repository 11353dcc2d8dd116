"""Drop-ins for `vllm.lora.ops.torch_ops` (same names, arguments, defaults),
and `lora_shrink`/`lora_expand`: all the slices of a layer in one call, in
the form of vLLM's Triton ops of those names.

CPU tensors go to the C++ kernels (`torch.ops.vllm_cpu_lora.*`); tensors on
any other device go to `vllm_cpu_lora.reference`, vLLM's pure-torch algorithm
(the path for CUDA GPUs below compute capability 8.0).
"""

import torch

from vllm_cpu_lora import _C, reference

__all__ = reference.__all__

# Bound once: a B=1 decode call costs ~2 us, and looking the op up (or
# `tensor.device.type`) on every call would add a third of that.
_cpu = {name: getattr(torch.ops.vllm_cpu_lora, name) for name in __all__}
_compiling = torch.compiler.is_compiling

# The decode and multi-slice ops first try the eager fast path of `_C`
# (py_module.cpp): it runs the CPU kernel without the ~1.4 us of a torch.ops
# call and answers False, having done nothing, whenever the dispatcher would
# have more to do (autograd, a tensor subclass or mode, fake or non-CPU
# tensors). Under torch.compile the branch is dead and the graph holds the
# torch.ops op.


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    if not _compiling() and _C.eager_bgmv_shrink(
        inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling
    ):
        return
    impl = _cpu["bgmv_shrink"] if inputs.is_cpu else reference.bgmv_shrink
    impl(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    if not _compiling() and _C.eager_bgmv_expand(
        inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs
    ):
        return
    impl = _cpu["bgmv_expand"] if inputs.is_cpu else reference.bgmv_expand
    impl(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    if not _compiling() and _C.eager_bgmv_expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        lora_indices_tensor,
        slice_offset,
        slice_size,
        add_inputs,
    ):
        return
    impl = (
        _cpu["bgmv_expand_slice"]
        if inputs.is_cpu
        else reference.bgmv_expand_slice
    )
    impl(
        inputs,
        lora_b_weights,
        output_tensor,
        lora_indices_tensor,
        slice_offset,
        slice_size,
        add_inputs,
    )


def sgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    scaling: float,
) -> None:
    impl = _cpu["sgmv_shrink"] if inputs.is_cpu else reference.sgmv_shrink
    impl(
        inputs,
        lora_a_weights,
        output_tensor,
        b_seq_start_loc,
        seq_len_tensor,
        lora_indices_tensor,
        batches,
        max_seq_length,
        token_nums,
        scaling,
    )


def sgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    add_inputs: bool = False,
) -> None:
    impl = _cpu["sgmv_expand"] if inputs.is_cpu else reference.sgmv_expand
    impl(
        inputs,
        lora_b_weights,
        output_tensor,
        b_seq_start_loc,
        seq_len_tensor,
        lora_indices_tensor,
        batches,
        max_seq_length,
        token_nums,
        add_inputs,
    )


def sgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = False,
) -> None:
    impl = (
        _cpu["sgmv_expand_slice"]
        if inputs.is_cpu
        else reference.sgmv_expand_slice
    )
    impl(
        inputs,
        lora_b_weights,
        output_tensor,
        b_seq_start_loc,
        seq_len_tensor,
        lora_indices_tensor,
        batches,
        max_seq_length,
        token_nums,
        slice_offset,
        slice_size,
        add_inputs,
    )


def lora_shrink(
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_indices: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    if not _compiling() and _C.eager_lora_shrink(
        inputs, lora_a_weights, output_tensor, token_lora_indices, scaling
    ):
        return
    impl = _cpu["lora_shrink"] if inputs.is_cpu else reference.lora_shrink
    impl(inputs, lora_a_weights, output_tensor, token_lora_indices, scaling)


def lora_expand(
    inputs: torch.Tensor,
    lora_b_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_indices: torch.Tensor,
    offset_start: int = 0,
    add_inputs: bool = True,
) -> None:
    if not _compiling() and _C.eager_lora_expand(
        inputs,
        lora_b_weights,
        output_tensor,
        token_lora_indices,
        offset_start,
        add_inputs,
    ):
        return
    impl = _cpu["lora_expand"] if inputs.is_cpu else reference.lora_expand
    impl(
        inputs,
        lora_b_weights,
        output_tensor,
        token_lora_indices,
        offset_start,
        add_inputs,
    )


def dispatch_bgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    indicies: torch.Tensor,
    layer_idx: int,
    scale: float,
) -> None:
    impl = _cpu["dispatch_bgmv"] if x.is_cpu else reference.dispatch_bgmv
    impl(y, x, w, indicies, layer_idx, scale)


def dispatch_bgmv_low_level(
    y: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    indicies: torch.Tensor,
    layer_idx: int,
    scale: float,
    h_in: int,
    h_out: int,
    y_offset: int,
) -> None:
    impl = (
        _cpu["dispatch_bgmv_low_level"]
        if x.is_cpu
        else reference.dispatch_bgmv_low_level
    )
    impl(y, x, w, indicies, layer_idx, scale, h_in, h_out, y_offset)


# Fake (meta) implementations so torch.compile can trace the ops: they only
# mutate their output argument, so there is nothing to compute. They also run
# for a call that mixes devices with "meta" (the dispatcher picks the Meta
# kernel), which must fail rather than silently do nothing.
def _make_fake(name: str):
    schema = getattr(torch.ops.vllm_cpu_lora, name).default._schema
    arg_names = [arg.name for arg in schema.arguments]

    def fake(*args, **kwargs):
        named = [*zip(arg_names, args, strict=False), *kwargs.items()]
        devices = {}
        for arg_name, value in named:
            tensors = value if isinstance(value, (list, tuple)) else [value]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    devices.setdefault(tensor.device, arg_name)
        if len(devices) > 1:
            where = ", ".join(f"{n} on {d}" for d, n in devices.items())
            raise RuntimeError(
                f"vllm_cpu_lora.{name}: all tensors must be on one device, "
                f"got {where}"
            )

    return fake


for _name in __all__:
    torch.library.register_fake(f"vllm_cpu_lora::{_name}")(_make_fake(_name))
