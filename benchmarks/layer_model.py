"""The Llama-2-7B decoder layer of the layer benchmark, and its LoRA.

The layer is computed the way vLLM does it, in bf16, without attention;
LoRA is applied as vLLM's ``PunicaWrapperCPU.add_lora_linear`` does (a
shrink and an expand per slice) with one of three implementations of the
ops, or as this package's wrapper does (one ``lora_shrink`` and one
``lora_expand`` per module: "fused"); see ``make_impls``. The weights are
kept cold: the base layer rotates through copies (``BaseLayer``), the
adapters through a pool larger than the caches (``LoraPool``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from benchmarks import baselines
from benchmarks.baselines import randn, reference
from vllm_cpu_lora import ops

HIDDEN = 4096
INTER = 11008
RANK = 16
_EPS = 1e-5

# (name, input width, output slices), in the order of the layer.
MODULES = (
    ("qkv_proj", HIDDEN, (HIDDEN, HIDDEN, HIDDEN)),
    ("o_proj", HIDDEN, (HIDDEN,)),
    ("gate_up_proj", HIDDEN, (INTER, INTER)),
    ("down_proj", INTER, (HIDDEN,)),
)

_T = torch.Tensor
# The implementations of the ops, in the order they are timed.
IMPLS = ("reference", "grouped", "ours", "fused")

# Layer outputs of grouped and ours against the reference's: max abs error
# over max |reference - base| (the LoRA's effect on the output).
CHECK_RTOL = 3e-2

# Per module: (A views, B views), one view per output slice.
Views = dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]


class BaseLayer:
    """Copies of one layer's base weights, used in turn (all cold)."""

    def __init__(self, copies: int, gen: torch.Generator) -> None:
        first = {
            name: randn(gen, sum(slices), width, scale=width**-0.5)
            for name, width, slices in MODULES
        }
        self.copies = [first] + [
            {k: v.clone() for k, v in first.items()} for _ in range(copies - 1)
        ]
        self.norms = (
            (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16),
            (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16),
        )
        self.step = 0

    @property
    def bytes_per_copy(self) -> int:
        """Bytes of one copy's projection weights."""
        return sum(
            w.numel() * w.element_size() for w in self.copies[0].values()
        )

    def next(self) -> dict[str, torch.Tensor]:
        """The next copy's weights (the least recently used)."""
        weights = self.copies[self.step % len(self.copies)]
        self.step += 1
        return weights


class LoraPool:
    """Adapter slots for every module slice, vLLM's stacked layout.

    Per slice, A is [slots, 1, r, in] and B is [slots, 1, out, r], as
    vLLM's ``lora_a_stacked`` / ``lora_b_stacked``; a case with L adapters
    sees a window of L consecutive slots (a view, as vLLM's stacked tensors
    with max_loras = L). The token indices of a case are renumbered so that
    the adapters in use are the first ones of the window, and each
    application moves the window on by the number in use: the slots it reads
    were last read a whole pool (``rotation_bytes``) ago, so they come from
    DRAM, not from a cache.
    """

    def __init__(self, rotation_bytes: int, gen: torch.Generator) -> None:
        seed_slots = 16  # Random slots, repeated to fill the pool.
        self.slot_bytes = (
            2
            * RANK
            * sum(
                width * len(slices) + sum(slices)
                for _, width, slices in MODULES
            )
        )
        self.slots = seed_slots * math.ceil(
            rotation_bytes / self.slot_bytes / seed_slots
        )
        reps = self.slots // seed_slots
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        for name, width, slices in MODULES:
            self.a[name] = [
                randn(gen, seed_slots, 1, RANK, width, scale=width**-0.5)
                .repeat(reps, 1, 1, 1)
                .contiguous()
                for _ in slices
            ]
            self.b[name] = [
                randn(gen, seed_slots, 1, n, RANK, scale=0.5 * RANK**-0.5)
                .repeat(reps, 1, 1, 1)
                .contiguous()
                for n in slices
            ]
        self.offset = 0

    @property
    def bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.slots * self.slot_bytes

    def window(self, start: int, count: int) -> Views:
        """Per module: (A views, B views) of slots [start, start + count)."""
        end = start + count
        return {
            name: (
                [a[start:end] for a in self.a[name]],
                [b[start:end] for b in self.b[name]],
            )
            for name, _, _ in MODULES
        }

    def next(self, adapters: int, used: int) -> Views:
        """The next cold window of `adapters` slots; `used` of them read."""
        if self.offset + adapters > self.slots:
            self.offset = 0
        views = self.window(self.offset, adapters)
        self.offset += max(used, 1)
        return views


# ----------------------------------------------------------------- LoRA


# add_lora_linear(y, x, A slices, B slices, output slices).
LinearFn = Callable[[_T, _T, list[_T], list[_T], tuple[int, ...]], None]


@dataclasses.dataclass
class Impl:
    """One implementation of a module's LoRA for one case."""

    linear: LinearFn


def _per_slice(
    shrink: Callable[[_T, _T, _T], None],
    expand: Callable[[_T, _T, _T, int, int], None],
) -> Impl:
    """vLLM's ``PunicaWrapperCPU.add_lora_linear`` (no buffer given): a
    zeroed fp32 buffer, a shrink and an expand-slice per slice."""

    def linear(
        y: _T, x: _T, a_slices: list[_T], b_slices: list[_T], slices: tuple
    ) -> None:
        buffers = [
            torch.zeros(x.size(0), RANK, dtype=torch.float32) for _ in slices
        ]
        for a, buf in zip(a_slices, buffers, strict=True):
            shrink(x, a, buf)
        offset = 0
        for b, buf, n in zip(b_slices, buffers, slices, strict=True):
            expand(buf, b, y, offset, n)
            offset += n

    return Impl(linear)


def _fused(token_indices: _T) -> Impl:
    """``PunicaWrapperCPULoRA.add_lora_linear``: one shrink and one expand
    over all slices, with each token's adapter."""

    def linear(
        y: _T, x: _T, a_slices: list[_T], b_slices: list[_T], slices: tuple
    ) -> None:
        buffer = torch.zeros(len(slices), x.size(0), RANK, dtype=torch.float32)
        ops.lora_shrink(x, a_slices, buffer, token_indices, 1.0)
        ops.lora_expand(buffer, b_slices, y, token_indices, 0, True)

    return Impl(linear)


def make_impls(
    indices: torch.Tensor, meta: tuple[Any, ...] | None
) -> dict[str, Impl]:
    """The implementations (IMPLS) bound to a case's mapping.

    Args:
        indices: decode: the adapter of each token.
        meta: prefill: vLLM's prefill metadata (b_seq_start_loc,
            seq_len_tensor, lora_indices_tensor, batches, max_seq_length,
            token_nums); None for decode.
    """
    if meta is None:
        idx = token_indices = indices

        def mod_shrink(mod: Any) -> Callable[..., None]:
            return lambda x, a, buf: mod.bgmv_shrink(x, a, buf, idx, 1.0)

        def mod_expand(mod: Any) -> Callable[..., None]:
            return lambda buf, b, y, off, n: mod.bgmv_expand_slice(
                buf, b, y, idx, off, n, True
            )

        def grouped_shrink(x: _T, a: _T, buf: _T) -> None:
            baselines.grouped_bgmv_shrink(x, a, buf, idx, 1.0)

        def grouped_expand(buf: _T, b: _T, y: _T, off: int, n: int) -> None:
            baselines.grouped_bgmv_expand(
                buf, b, y[:, off : off + n], idx, True
            )

    else:
        starts, lengths, lora_idx, batches = meta[:4]
        token_indices = torch.repeat_interleave(lora_idx, lengths)

        def mod_shrink(mod: Any) -> Callable[..., None]:
            return lambda x, a, buf: mod.sgmv_shrink(x, a, buf, *meta, 1.0)

        def mod_expand(mod: Any) -> Callable[..., None]:
            return lambda buf, b, y, off, n: mod.sgmv_expand_slice(
                buf, b, y, *meta, off, n, True
            )

        def grouped_shrink(x: _T, a: _T, buf: _T) -> None:
            baselines.grouped_sgmv_shrink(
                x, a, buf, starts, lengths, lora_idx, batches, 1.0
            )

        def grouped_expand(buf: _T, b: _T, y: _T, off: int, n: int) -> None:
            baselines.grouped_sgmv_expand(
                buf,
                b,
                y[:, off : off + n],
                starts,
                lengths,
                lora_idx,
                batches,
                True,
            )

    return {
        "reference": _per_slice(mod_shrink(reference), mod_expand(reference)),
        "grouped": _per_slice(grouped_shrink, grouped_expand),
        "ours": _per_slice(mod_shrink(ops), mod_expand(ops)),
        "fused": _fused(token_indices),
    }


# ---------------------------------------------------------------- layer


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's RMSNorm.forward_native (no residual)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _EPS)
    return h.to(x.dtype) * weight


def layer_forward(
    base: dict[str, torch.Tensor],
    norms: tuple[torch.Tensor, torch.Tensor],
    x: torch.Tensor,
    lora: tuple[Impl, Views] | None = None,
    acts: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decoder layer without attention; ``lora`` = (Impl, views).

    ``acts``, if given, receives each projection's input.
    """
    slices = {name: s for name, _, s in MODULES}

    def proj(name: str, inp: torch.Tensor) -> torch.Tensor:
        if acts is not None:
            acts[name] = inp
        out = F.linear(inp, base[name])
        if lora is not None:
            impl, views = lora
            a, b = views[name]
            impl.linear(out, inp, a, b, slices[name])
        return out

    qkv = proj("qkv_proj", rms_norm(x, norms[0]))
    attn = qkv[:, :HIDDEN].contiguous()  # Stands in for attention's output.
    h = x + proj("o_proj", attn)
    gate_up = proj("gate_up_proj", rms_norm(h, norms[1]))
    act = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    return h + proj("down_proj", act)


def lora_only(
    impl: Impl,
    views: Views,
    acts: dict[str, torch.Tensor],
    outs: dict[str, torch.Tensor],
) -> None:
    """The LoRA part of a layer alone, into preallocated outputs."""
    for name, _, slices in MODULES:
        a, b = views[name]
        impl.linear(outs[name], acts[name], a, b, slices)
