"""Probes of what vLLM passes (index -1, its dtypes and weight layout, odd
segment lengths), run through ours and IPEX, and the output verdicts the
IPEX benchmark shares."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import baselines
from benchmarks.baselines import reference
from vllm_cpu_lora import ops

# A call that writes its result into the output tensor it is given.
OutFn = Callable[[torch.Tensor], None]


def compare(
    got: torch.Tensor, expected: torch.Tensor, initial: torch.Tensor
) -> dict[str, Any]:
    """Verdict on one output: ok, or the rows that are wrong (NaN counts as
    wrong)."""
    err = (got.float() - expected.float()).abs()
    delta = (expected.float() - initial.float()).abs().max().item()
    tol = baselines.CHECK_RTOL * delta + baselines.CHECK_ATOL
    bad = (~(err <= tol)).any(dim=1).nonzero().flatten().tolist()
    finite = err[torch.isfinite(err)]
    max_err = finite.max().item() if finite.numel() else math.nan
    nan_count = int((~torch.isfinite(got.float())).sum())
    if not bad:
        return {"ok": True, "max_error": max_err, "detail": "ok"}
    if torch.equal(got, initial) and delta > 0:
        detail = "no-op: output left unchanged"
    else:
        detail = (
            f"wrong in {len(bad)} of {got.size(0)} rows "
            f"(first {bad[:6]}); max finite error {max_err:.3g}, "
            f"{nan_count} non-finite values; reference change max "
            f"{delta:.3g}"
        )
    return {
        "ok": False,
        "max_error": max_err,
        "bad_rows": bad,
        "detail": detail,
    }


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, at most 200 characters."""
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


@dataclasses.dataclass
class Probe:
    """A small input vLLM may pass, run through ours and IPEX.

    Each side has its own initial output and a reference that computes what
    vLLM's semantics want from that side's inputs.
    """

    name: str
    want: str
    threads: int
    ours_initial: torch.Tensor
    ours: OutFn
    ours_reference: OutFn
    ipex_initial: torch.Tensor
    ipex: OutFn
    ipex_reference: OutFn


def _run_side(fn: OutFn, ref_fn: OutFn, initial: torch.Tensor) -> str:
    """One side of a probe: ok, or what is wrong with its output."""
    expected = initial.clone()
    ref_fn(expected)
    out = initial.clone()
    try:
        fn(out)
    except Exception as exc:
        return f"raises {type(exc).__name__}: {first_line(exc)}"
    return compare(out, expected, initial)["detail"]


def build_probes(ipex_ops: Any, all_threads: int) -> list[Probe]:
    """Small cases on vLLM's contract (reference.py's semantics)."""
    gen = torch.Generator().manual_seed(1234)
    bf16, fp32 = torch.bfloat16, torch.float32
    h, r, n, n_ad, t = 256, 16, 128, 4, 8

    randn = functools.partial(baselines.randn, gen)

    def after_slot_of_ones(weights: torch.Tensor) -> torch.Tensor:
        # IPEX reads adapter -1 at weights[-1], one adapter before the
        # tensor: put a slot of ones there so the read stays in bounds.
        buf = torch.ones(weights.size(0) + 1, *weights.shape[1:]).to(
            weights.dtype
        )
        buf[1:] = weights
        return buf[1:]

    x = randn(t, h)
    a = after_slot_of_ones(randn(n_ad, r, h, scale=h**-0.5))
    b = after_slot_of_ones(randn(n_ad, n, r, scale=r**-0.5))
    y32 = randn(t, r, dtype=fp32)
    y16 = y32.to(bf16)
    start = randn(t, n, scale=1e-2)
    idx_neg = torch.tensor([0, -1, 1, 2, -1, 3, 0, 1])
    idx = torch.tensor([0, 3, 1, 2, 2, 3, 0, 1])
    zeros32 = torch.zeros(t, r, dtype=fp32)
    zeros16 = torch.zeros(t, r, dtype=bf16)
    op = ipex_ops
    probes = [
        Probe(
            "bgmv_shrink, index -1 in a decode batch",
            "rows with -1 get zeros",
            all_threads,
            zeros32,
            lambda o: ops.bgmv_shrink(x, a, o, idx_neg, 1.0),
            lambda o: reference.bgmv_shrink(x, a, o, idx_neg, 1.0),
            zeros16,
            lambda o: op.punica_bgmv_shrink(o, x, a, idx_neg, 1.0),
            lambda o: reference.bgmv_shrink(x, a, o, idx_neg, 1.0),
        ),
        Probe(
            "bgmv_expand (add_inputs), index -1 in a decode batch",
            "rows with -1 left untouched",
            all_threads,
            start,
            lambda o: ops.bgmv_expand(y32, b, o, idx_neg, True),
            lambda o: reference.bgmv_expand(y32, b, o, idx_neg, True),
            start,
            lambda o: op.punica_bgmv_expand(o, y16, b, idx_neg, True),
            lambda o: reference.bgmv_expand(y16, b, o, idx_neg, True),
        ),
    ]

    def sgmv_probe(
        name: str,
        want: str,
        threads: int,
        kind: str,
        lens: list[int],
        seg_idx: list[int],
    ) -> Probe:
        lens_t = torch.tensor(lens)
        starts = torch.cumsum(lens_t, 0) - lens_t
        seg_t = torch.tensor(seg_idx)
        batches = len(lens)
        hints = (max(lens), sum(lens))
        y = y16
        if kind == "shrink":
            return Probe(
                name,
                want,
                threads,
                zeros16,
                lambda o: ops.sgmv_shrink(
                    x, a, o, starts, lens_t, seg_t, batches, *hints, 1.0
                ),
                lambda o: reference.sgmv_shrink(
                    x, a, o, starts, lens_t, seg_t, batches, *hints, 1.0
                ),
                zeros16,
                lambda o: op.punica_sgmv_shrink(o, x, a, seg_t, lens_t, 1.0),
                lambda o: reference.sgmv_shrink(
                    x, a, o, starts, lens_t, seg_t, batches, *hints, 1.0
                ),
            )
        return Probe(
            name,
            want,
            threads,
            start,
            lambda o: ops.sgmv_expand(
                y, b, o, starts, lens_t, seg_t, batches, *hints, True
            ),
            lambda o: reference.sgmv_expand(
                y, b, o, starts, lens_t, seg_t, batches, *hints, True
            ),
            start,
            lambda o: op.punica_sgmv_expand(o, y, b, seg_t, lens_t, True),
            lambda o: reference.sgmv_expand(
                y, b, o, starts, lens_t, seg_t, batches, *hints, True
            ),
        )

    probes.append(
        sgmv_probe(
            "sgmv_shrink, a segment with index -1",
            "its rows get zeros",
            all_threads,
            "shrink",
            [4, 4],
            [-1, 2],
        )
    )
    for threads in dict.fromkeys((all_threads, 1)):
        probes.append(
            sgmv_probe(
                f"sgmv_shrink, segments of 3 and 5 tokens, {threads} thr",
                "each segment uses its adapter",
                threads,
                "shrink",
                [3, 5],
                [1, 2],
            )
        )
        probes.append(
            sgmv_probe(
                f"sgmv_expand, segments of 3 and 5 tokens, {threads} thr",
                "each segment uses its adapter",
                threads,
                "expand",
                [3, 5],
                [1, 2],
            )
        )
    a32, b32, x32 = a.float(), b.float(), x.float()
    start32 = start.float()
    a4 = a.unsqueeze(1)
    probes += [
        Probe(
            "bgmv_shrink with vLLM's dtypes (bf16 in, fp32 buffer)",
            "fp32 output",
            all_threads,
            zeros32,
            lambda o: ops.bgmv_shrink(x, a, o, idx, 1.0),
            lambda o: reference.bgmv_shrink(x, a, o, idx, 1.0),
            zeros32,
            lambda o: op.punica_bgmv_shrink(o, x, a, idx, 1.0),
            lambda o: reference.bgmv_shrink(x, a, o, idx, 1.0),
        ),
        Probe(
            "bgmv_expand with vLLM's dtypes (fp32 buffer in, bf16 out)",
            "bf16 output",
            all_threads,
            start,
            lambda o: ops.bgmv_expand(y32, b, o, idx, True),
            lambda o: reference.bgmv_expand(y32, b, o, idx, True),
            start,
            lambda o: op.punica_bgmv_expand(o, y32, b, idx, True),
            lambda o: reference.bgmv_expand(y32, b, o, idx, True),
        ),
        Probe(
            "bgmv_shrink, everything fp32",
            "fp32 output",
            all_threads,
            zeros32,
            lambda o: ops.bgmv_shrink(x32, a32, o, idx, 1.0),
            lambda o: reference.bgmv_shrink(x32, a32, o, idx, 1.0),
            zeros32,
            lambda o: op.punica_bgmv_shrink(o, x32, a32, idx, 1.0),
            lambda o: reference.bgmv_shrink(x32, a32, o, idx, 1.0),
        ),
        Probe(
            "bgmv_expand (add_inputs), everything fp32",
            "fp32 output",
            all_threads,
            start32,
            lambda o: ops.bgmv_expand(y32, b32, o, idx, True),
            lambda o: reference.bgmv_expand(y32, b32, o, idx, True),
            start32,
            lambda o: op.punica_bgmv_expand(o, y32, b32, idx, True),
            lambda o: reference.bgmv_expand(y32, b32, o, idx, True),
        ),
        Probe(
            "bgmv_shrink, vLLM's 4-D weights [L, 1, r, H]",
            "same as 3-D",
            all_threads,
            zeros16,
            lambda o: ops.bgmv_shrink(x, a4, o, idx, 1.0),
            lambda o: reference.bgmv_shrink(x, a4, o, idx, 1.0),
            zeros16,
            lambda o: op.punica_bgmv_shrink(o, x, a4, idx, 1.0),
            lambda o: reference.bgmv_shrink(x, a4, o, idx, 1.0),
        ),
    ]
    return probes


def run_probes(ipex_ops: Any, all_threads: int) -> list[dict[str, Any]]:
    """Runs every probe on both sides; what each side did."""
    results = []
    try:
        for probe in build_probes(ipex_ops, all_threads):
            torch.set_num_threads(probe.threads)
            results.append(
                {
                    "name": probe.name,
                    "want": probe.want,
                    "threads": probe.threads,
                    "ours": _run_side(
                        probe.ours, probe.ours_reference, probe.ours_initial
                    ),
                    "ipex": _run_side(
                        probe.ipex, probe.ipex_reference, probe.ipex_initial
                    ),
                }
            )
    finally:
        torch.set_num_threads(all_threads)
    return results
