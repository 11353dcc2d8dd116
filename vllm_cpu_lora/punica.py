"""vLLM Punica wrapper for CPUs that runs this package's C++ LoRA kernels.

`PunicaWrapperCPULoRA` is vLLM's `PunicaWrapperCPU` (metadata, slicing and
buffers unchanged) with every op it calls from `vllm.lora.ops.torch_ops`
replaced by its drop-in from `vllm_cpu_lora.ops`: shrink, expand and
expand_slice, in the prefill (sgmv) and decode (bgmv) forms, as used by
linear, embedding, logits and full-linear (classifier) LoRA layers.

vLLM picks it through `vllm_cpu_lora.plugin`. Each op call is counted per
process (`call_counts()`); the first call of each op is logged with its
shapes and dtypes, so a log shows which ops were routed here. Importing this
module needs vLLM.
"""

import collections
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from vllm_cpu_lora import ops

__all__ = [
    "PunicaWrapperCPULoRA",
    "call_counts",
    "reset_call_counts",
    "worker_lora_report",
]

# Under "vllm" so that vLLM's logging configuration applies to it.
logger = init_logger("vllm.plugins." + __name__)

_calls: collections.Counter[str] = collections.Counter()


def call_counts() -> dict[str, int]:
    """Returns how often each op ran through this process's wrappers."""
    return dict(_calls)


def reset_call_counts() -> None:
    """Forgets the counts `call_counts` returns (the first-call log too)."""
    _calls.clear()


def _describe(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}{list(tensor.shape)}"


def _count(
    op: str, inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor
) -> None:
    if op not in _calls:
        logger.info(
            "vllm_cpu_lora: first %s call: inputs %s, weights %s, output %s",
            op,
            _describe(inputs),
            _describe(weights),
            _describe(output),
        )
    _calls[op] += 1


class PunicaWrapperCPULoRA(PunicaWrapperCPU):
    """`PunicaWrapperCPU` on `vllm_cpu_lora`'s kernels.

    Same constructor, metadata and semantics as vLLM's wrapper; only the
    kernels differ. Slices are still applied one op call at a time.
    """

    # vLLM's property (PunicaWrapperBase), typed here too for a check that
    # runs without vLLM, where the base class is Any and `*` of it would
    # fill every parameter: seq_start_locs, seq_lengths,
    # lora_indices_per_batch, batch_size, max_length, token_nums.
    prefill_metadata: tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, int, int, int
    ]

    def _shrink_prefill(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        w_t_all: torch.Tensor,
        scale: float,
    ) -> None:
        if self.no_lora:
            return
        _count("sgmv_shrink", x, w_t_all, y)
        ops.sgmv_shrink(x, w_t_all, y, *self.prefill_metadata, scale)

    def _shrink_decode(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        w_t_all: torch.Tensor,
        scale: float,
    ) -> None:
        _count("bgmv_shrink", x, w_t_all, y)
        ops.bgmv_shrink(x, w_t_all, y, self.token_lora_indices, scale)

    def _expand_prefill(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        w_t_all: torch.Tensor,
        add_inputs: bool,
    ) -> None:
        if self.no_lora:
            return
        _count("sgmv_expand", x, w_t_all, y)
        ops.sgmv_expand(x, w_t_all, y, *self.prefill_metadata, add_inputs)

    def _expand_decode(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        w_t_all: torch.Tensor,
        add_inputs: bool,
    ) -> None:
        _count("bgmv_expand", x, w_t_all, y)
        ops.bgmv_expand(x, w_t_all, y, self.token_lora_indices, add_inputs)

    def _expand_slice_prefill(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        w_t_all: torch.Tensor,
        y_offset: int,
        y_slice_size: int,
        add_inputs: bool,
    ) -> None:
        if self.no_lora:
            return
        _count("sgmv_expand_slice", x, w_t_all, y)
        ops.sgmv_expand_slice(
            x,
            w_t_all,
            y,
            *self.prefill_metadata,
            y_offset,
            y_slice_size,
            add_inputs,
        )

    def _expand_slice_decode(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        w_t_all: torch.Tensor,
        y_offset: int,
        y_slice_size: int,
        add_inputs: bool,
    ) -> None:
        _count("bgmv_expand_slice", x, w_t_all, y)
        ops.bgmv_expand_slice(
            x,
            w_t_all,
            y,
            self.token_lora_indices,
            y_offset,
            y_slice_size,
            add_inputs,
        )

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """LoRA for `LogitsProcessorWithLoRA`, as vLLM's wrapper does it.

        Semantics: ``y += (x @ lora_a_stacked * scale) @ lora_b_stacked``,
        per row by `sampler_indices`, through an fp32 buffer.
        """
        y_org = y
        y = y.view(-1, y.shape[-1])
        x = x.view(-1, x.shape[-1])
        r = lora_b_stacked.size(-1)
        if buffer is None:
            buffer = torch.zeros(
                (x.size(0), r), dtype=torch.float32, device=x.device
            )
        _count("bgmv_shrink", x, lora_a_stacked, buffer)
        ops.bgmv_shrink(x, lora_a_stacked, buffer, self.sampler_indices, scale)
        _count("bgmv_expand", buffer, lora_b_stacked, y)
        ops.bgmv_expand(
            buffer, lora_b_stacked, y, self.sampler_indices, add_inputs=True
        )
        y = y.view_as(y_org)

    def apply_lora_full_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        weight_stacked: torch.Tensor,
        bias_stacked: torch.Tensor,
        module_enabled: torch.Tensor,
    ) -> None:
        """Full (non-low-rank) adapter heads, as vLLM's wrapper does them."""
        indices = self.sampler_indices
        adapter_y = torch.zeros(
            (x.size(0), weight_stacked.size(-2)),
            dtype=torch.float32,
            device=x.device,
        )
        _count("bgmv_shrink", x, weight_stacked, adapter_y)
        ops.bgmv_shrink(x, weight_stacked, adapter_y, indices, 1.0)
        result = self._select_full_linear_output(
            y, adapter_y, bias_stacked, module_enabled
        )
        y.copy_(result)


def _punica_wrappers(worker: Any) -> list[Any]:
    """The Punica wrappers of a vLLM worker's LoRA model manager."""
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    adapters = getattr(manager, "_adapter_manager", None)
    mapping = getattr(adapters, "punica_wrapper_mapping", None) or {}
    return list(mapping.values())


def worker_lora_report(worker: Any = None) -> dict[str, Any]:
    """What a vLLM worker used for LoRA: for `LLM.collective_rpc`.

    Args:
        worker: The vLLM worker (`collective_rpc` passes it).

    Returns:
        ``{"wrappers": [qualified class names], "calls": call_counts()}``.
    """
    wrappers = sorted(
        {
            f"{type(w).__module__}.{type(w).__qualname__}"
            for w in _punica_wrappers(worker)
        }
    )
    return {"wrappers": wrappers, "calls": call_counts()}
