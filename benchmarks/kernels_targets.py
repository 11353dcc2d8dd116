"""The kernel benchmark's targets of issue #16, per ISA path and thread count.

Over the bf16 and fp32 cases of a run: none slower than grouped torch, no
decode case below 20% of its in-cache bound, one-token expands within 3x of
theirs; over the targets' grid, decode at 50% of the bound and prefill at
70% of the path's peak (geomeans). Beside the 60x over the reference goes
what that ratio would be if every case ran at its bound, since the bound,
not the kernels, decides whether 60x can be reached on a machine.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks import report
from benchmarks.report import Target

_MIN_VS_GROUPED = 1.0
_DECODE_BOUND_GEOMEAN = 0.5
_DECODE_BOUND_FLOOR = 0.2
_ONE_TOKEN_BOUND_FACTOR = 3.0
_PREFILL_PEAK_FRACTION = 0.7


def vs_reference_at_bound(rows: list[dict[str, Any]]) -> float:
    """Geomean of the reference's time over each case's best possible time.

    The best possible time is the bound's, or ours where a case beats its
    bound (its bytes stayed in a nearer cache than the bound assumes): no
    kernel can pass this figure on this machine.
    """
    return report.geomean(
        r["median_s"]["reference"] / min(r["bound_s"], r["median_s"]["ours"])
        for r in rows
    )


def _slowest_vs_grouped(rows: list[dict[str, Any]]) -> Target:
    slow = [r for r in rows if r["speedup_vs_grouped"] < _MIN_VS_GROUPED]
    worst = min(rows, key=lambda r: r["speedup_vs_grouped"])
    return (
        "bf16 and fp32 cases slower than grouped torch",
        not slow,
        f"{len(slow)} of {len(rows)}; the slowest {worst['label']} "
        f"{worst['speedup_vs_grouped']:.2f}x",
    )


def _below(
    name: str, rows: list[dict[str, Any]], fraction: float, fixed_us: float
) -> Target:
    """Cases below a fraction of their bound, and how many the call's fixed
    cost keeps there however fast their loops run (a call takes at least
    the fixed cost plus the bound)."""
    low = [r for r in rows if r["fraction_of_bound"] < fraction]
    by_fixed = [
        r
        for r in low
        if fixed_us * 1e-6 + r["bound_s"] > r["bound_s"] / fraction
    ]
    lowest = ""
    if rows:
        worst = min(rows, key=lambda r: r["fraction_of_bound"])
        lowest = f"; the lowest {worst['label']} "
        lowest += report.pct(worst["fraction_of_bound"])
    return (
        name,
        not low,
        f"{len(low)} of {len(rows)}, {len(by_fixed)} of them held there by "
        f"the B=1 fixed cost ({fixed_us:.2f} us){lowest}",
    )


def _at_least(name: str, value: float, limit: float) -> Target:
    if math.isnan(value):
        return (name, None, "no cases")
    return (name, value >= limit, f"{report.num(value)} (>= {limit:g})")


def issue16_targets(
    tag: str,
    rows: list[dict[str, Any]],
    summary: dict[str, float],
    peak_name: str,
) -> list[Target]:
    """#16's targets for one thread count.

    Args:
        tag: the thread count, as the target names start ("[2 threads]").
        rows: the results of that thread count.
        summary: its geomeans over the grid (`kernels_report.summarize`).
        peak_name: the peak of 'of bf16 peak' on the run's ISA path.
    """
    exact = [r for r in rows if r["dtype"] in ("bf16", "fp32")]
    decode = [r for r in exact if r["family"] == "bgmv"]
    if not decode:
        return [(f"{tag} #16 targets", None, "no bf16 or fp32 decode cases")]
    targets = [
        _slowest_vs_grouped(exact),
        _at_least(
            "decode geomean fraction of the in-cache bound",
            summary["bgmv_fraction_of_bound"],
            _DECODE_BOUND_GEOMEAN,
        ),
        _below(
            f"bf16 and fp32 decode cases below {_DECODE_BOUND_FLOOR:.0%} of "
            "their bound",
            decode,
            _DECODE_BOUND_FLOOR,
            summary["fixed_cost_us"],
        ),
        _below(
            "bf16 and fp32 one-token expands beyond "
            f"{_ONE_TOKEN_BOUND_FACTOR:g}x their bound",
            [
                r
                for r in decode
                if r["op"] == "bgmv_expand" and r["tokens"] == 1
            ],
            1 / _ONE_TOKEN_BOUND_FACTOR,
            summary["fixed_cost_us"],
        ),
        _at_least(
            f"prefill geomean fraction of the {peak_name} peak",
            summary["sgmv_fraction_of_bf16_peak"],
            _PREFILL_PEAK_FRACTION,
        ),
    ]
    return [(f"{tag} {name}", ok, detail) for name, ok, detail in targets]
