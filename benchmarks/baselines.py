"""What our kernels are measured against, and on which inputs.

* ``reference``: ``vllm_cpu_lora.reference``, vLLM's pure-torch algorithm
  (a per-token gather of the weights), the correctness yardstick;
* grouped torch (``grouped_*``): pure torch written here, tokens grouped by
  adapter with one ``torch.mm`` per adapter in use (a Python loop over the
  adapters), the best a torch-only wrapper could do.

The grouped functions take vLLM's op arguments (3-D or vLLM's 4-D stacked
weights) in the order of ``vllm_cpu_lora.ops``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from vllm_cpu_lora import reference

__all__ = [
    "CHECK_ATOL",
    "CHECK_RTOL",
    "grouped_bgmv_expand",
    "grouped_bgmv_shrink",
    "grouped_sgmv_expand",
    "grouped_sgmv_shrink",
    "randn",
    "reference",
]

# Sanity tolerance of the benchmarks' checks (the real tests live in
# tests/): max |impl - reference| must stay below this fraction of the
# largest change the reference made to the output, plus a small slack.
CHECK_RTOL = 3e-2
CHECK_ATOL = 1e-2


def randn(
    gen: torch.Generator,
    *shape: int,
    scale: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Normal values times scale, drawn in fp32 from gen, then cast."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _group_rows(
    indices: torch.Tensor, num_adapters: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yields (adapter, token rows) for every adapter in use (indices >= 0)."""
    order = torch.argsort(indices, stable=True)
    counts = torch.bincount(indices, minlength=num_adapters).tolist()
    start = 0
    for adapter, count in enumerate(counts):
        if count:
            yield adapter, order[start : start + count]
            start += count


def _three_d(weights: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked [L, 1, rows, cols] weights as [L, rows, cols]."""
    return weights.squeeze(1) if weights.dim() == 4 else weights


def grouped_bgmv_shrink(
    x: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """out[rows] = scaling * x[rows] @ A[a].T, one torch.mm per adapter."""
    weights = _three_d(weights)
    rank = weights.size(1)
    for adapter, rows in _group_rows(indices, weights.size(0)):
        prod = torch.mm(x.index_select(0, rows), weights[adapter].t())
        prod = prod.to(out.dtype)
        if scaling != 1.0:
            prod.mul_(scaling)
        out[:, :rank].index_copy_(0, rows, prod)


def grouped_bgmv_expand(
    y: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """out[rows] (+)= y[rows] @ B[a].T, one torch.mm per adapter."""
    weights = _three_d(weights)
    width = min(weights.size(1), out.size(1))
    target = out if width == out.size(1) else out[:, :width]
    for adapter, rows in _group_rows(indices, weights.size(0)):
        ys = y.index_select(0, rows).to(weights.dtype)
        prod = torch.mm(ys, weights[adapter, :width].t()).to(out.dtype)
        if add_inputs:
            target.index_add_(0, rows, prod)
        else:
            target.index_copy_(0, rows, prod)


def _segments(
    starts: torch.Tensor,
    lengths: torch.Tensor,
    indices: torch.Tensor,
    batches: int,
) -> Iterator[tuple[slice, int]]:
    """Yields (token rows, adapter) of every non-empty segment with one."""
    for start, length, adapter in zip(
        starts[:batches].tolist(),
        lengths[:batches].tolist(),
        indices[:batches].tolist(),
        strict=True,
    ):
        if length and adapter >= 0:
            yield slice(start, start + length), adapter


def grouped_sgmv_shrink(
    x: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    indices: torch.Tensor,
    batches: int,
    scaling: float = 1.0,
) -> None:
    """Per segment: out[seg] = scaling * x[seg] @ A[a].T (one torch.mm)."""
    weights = _three_d(weights)
    rank = weights.size(1)
    for seg, adapter in _segments(starts, lengths, indices, batches):
        dest = out[seg, :rank]
        if dest.dtype == x.dtype and dest.is_contiguous():
            torch.mm(x[seg], weights[adapter].t(), out=dest)
        else:
            dest.copy_(torch.mm(x[seg], weights[adapter].t()))
        if scaling != 1.0:
            dest.mul_(scaling)


def grouped_sgmv_expand(
    y: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    indices: torch.Tensor,
    batches: int,
    add_inputs: bool = False,
) -> None:
    """Per segment: out[seg] (+)= y[seg] @ B[a].T (one addmm / mm)."""
    weights = _three_d(weights)
    width = min(weights.size(1), out.size(1))
    for seg, adapter in _segments(starts, lengths, indices, batches):
        dest = out[seg, :width]
        ys = y[seg].to(weights.dtype)
        if add_inputs and dest.dtype == ys.dtype:
            dest.addmm_(ys, weights[adapter, :width].t())
        elif add_inputs:
            dest.add_(torch.mm(ys, weights[adapter, :width].t()))
        else:
            dest.copy_(torch.mm(ys, weights[adapter, :width].t()))
