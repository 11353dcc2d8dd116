"""vLLM Punica wrapper for CPUs that runs this package's C++ LoRA kernels.

`PunicaWrapperCPULoRA` is vLLM's `PunicaWrapperCPU` (metadata and buffers
unchanged) with its LoRA application replaced: a linear layer's LoRA is one
`lora_shrink` and one `lora_expand` call over all its slices (qkv: 3,
gate_up: 2) where vLLM's wrapper loops over the slices in Python, and
embedding, logits and full-linear (classifier) LoRA run this package's bgmv
ops where vLLM's run its torch ops.

What the layers inside the model call (`add_shrink`, `add_expand`,
`add_lora_linear`, `add_lora_embedding`) reads no per-batch Python state:
the token count comes from the input's shape and each token's adapter from
the `_token_lora_indices` buffer, which vLLM updates in place before every
step. A model compiled once (vLLM's `DYNAMO_TRACE_ONCE`, which then skips
dynamo's guards) therefore stays right for every later batch, where vLLM's
wrapper would replay the prefill/decode choice, `no_lora` and segment counts
of the batch it was traced with.

vLLM picks it through `vllm_cpu_lora.plugin`. The ops count their own calls
per process (`call_counts()`), compiled graphs' calls included. Importing
this module needs vLLM.
"""

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from vllm_cpu_lora import _C, ops

__all__ = [
    "PunicaWrapperCPULoRA",
    "call_counts",
    "reset_call_counts",
    "worker_lora_report",
]


def call_counts() -> dict[str, int]:
    """How often each op of this package ran in this process."""
    return _C.call_counts()


def reset_call_counts() -> None:
    """Sets the counts `call_counts` returns back to 0."""
    _C.reset_call_counts()


class PunicaWrapperCPULoRA(PunicaWrapperCPU):
    """`PunicaWrapperCPU` on `vllm_cpu_lora`'s kernels, safe to compile.

    Same constructor, metadata and semantics as vLLM's wrapper.
    """

    def update_metadata(
        self,
        mapping: Any,
        lora_index_to_id: list[int | None],
        max_loras: int,
        vocab_size: int,
        **kwargs: Any,
    ) -> None:
        super().update_metadata(
            mapping, lora_index_to_id, max_loras, vocab_size, **kwargs
        )
        # The layers read one entry per input row: rows past the mapping
        # (padding) get no LoRA rather than a stale or uninitialised index.
        self._token_lora_indices[self.indices_len[0] :].fill_(-1)

    def _token_indices(self, num_tokens: int) -> torch.Tensor:
        # Sliced by the input's (symbolic, when traced) row count, not by
        # vLLM's Python-side length.
        return self._token_lora_indices[:num_tokens]

    def add_shrink(
        self,
        y: tuple[torch.Tensor, ...] | torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        scale: float,
        **kwargs: Any,
    ) -> None:
        """``y[s] = scale * x @ lora_a_stacked[s]`` per token's adapter, for
        every slice s (zeros for tokens without one)."""
        x = x.view(-1, x.shape[-1])
        indices = self._token_indices(x.size(0))
        if isinstance(y, torch.Tensor):
            ops.lora_shrink(x, list(lora_a_stacked), y, indices, scale)
            return
        for y_slice, a_slice in zip(y, lora_a_stacked, strict=True):
            ops.lora_shrink(x, [a_slice], y_slice.unsqueeze(0), indices, scale)

    def add_expand(
        self,
        y: torch.Tensor,
        x: tuple[torch.Tensor, ...] | torch.Tensor,
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """``y[:, offset:offset + output_slices[s]] (+)= x[s] @
        lora_b_stacked[s]`` per token's adapter, the slices side by side
        from `offset_start`; tokens without an adapter are left alone."""
        rows = tuple(b.size(-2) for b in lora_b_stacked)
        if tuple(output_slices) != rows:
            raise ValueError(
                f"output_slices {tuple(output_slices)} differ from the rows "
                f"{rows} of lora_b_stacked"
            )
        y = y.view(-1, y.shape[-1])
        if not isinstance(x, torch.Tensor):
            x = torch.stack(x)
        ops.lora_expand(
            x,
            list(lora_b_stacked),
            y,
            self._token_indices(y.size(0)),
            offset_start,
            add_inputs,
        )

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """``y (+)= x @ lora_b_stacked`` per token's adapter, for
        `VocabParallelEmbeddingWithLoRA`."""
        ops.bgmv_expand(
            x, lora_b_stacked, y, self._token_indices(x.size(0)), add_inputs
        )

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """``y += scale * x @ lora_a_stacked[s] @ lora_b_stacked[s]`` per
        token's adapter, slice s into its columns: one shrink and one
        expand call, through an fp32 buffer as vLLM's wrappers."""
        x = x.view(-1, x.shape[-1])
        if buffer is None:
            buffer = torch.zeros(
                (len(output_slices), x.size(0), lora_b_stacked[0].size(-1)),
                dtype=torch.float32,
                device=x.device,
            )
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices)

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
        ops.bgmv_shrink(x, lora_a_stacked, buffer, self.sampler_indices, scale)
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
        ``{"wrappers": [qualified class names], "calls": call_counts(),
        "compilation_mode": the worker's vLLM compilation mode name,
        "dynamo_graphs": graphs torch.compile captured in this process,
        "dynamo_compiles": [function name, recompile reason or None] for each
        frame dynamo compiled in this process}``.
    """
    wrappers = sorted(
        {
            f"{type(w).__module__}.{type(w).__qualname__}"
            for w in _punica_wrappers(worker)
        }
    )
    config = getattr(worker, "vllm_config", None)
    mode = getattr(getattr(config, "compilation_config", None), "mode", None)
    return {
        "wrappers": wrappers,
        "calls": call_counts(),
        "compilation_mode": getattr(mode, "name", None),
        "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "dynamo_compiles": [
            [m.co_name, m.recompile_reason]
            for m in torch._dynamo.utils.get_compilation_metrics()
        ],
    }
