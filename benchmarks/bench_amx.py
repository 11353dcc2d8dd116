"""AMX vs AVX512-BF16 vs the torch reference, by tokens per adapter.

The forced "amx" path runs groups of at least AmxMinTokens tokens on the
regular tiles (weights packed into VNNI pairs) and smaller groups on the
swapped-operand tiles (weights read in place); the automatic rule (both
thresholds in csrc/cpu/tuning.h: AmxMinTokens, AmxSwapMinTokens)
chooses between those and AVX512-BF16 per group. This table shows whether it
chose well. Every case is timed side by side in one process, interleaved,
medians of repeats; results are ratios, never one absolute time. Needs a CPU
with AMX (the "amx" ISA path); elsewhere it says so and exits.

    python -m benchmarks.bench_amx [--out benchmarks/results/<cpu slug>/amx.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import pathlib
import statistics
from collections.abc import Callable

import torch

import vllm_cpu_lora
from benchmarks import common, machine, timing
from benchmarks.baselines import reference
from vllm_cpu_lora import ops

_HIDDEN = 4096
_HOUT = 4096
_RANK = 16
_ADAPTERS = 4
_TOKENS_PER_ADAPTER = (1, 2, 4, 8, 12, 16, 24, 32, 64, 128)
_PATHS = ("amx", "avx512_bf16")


def _median_time(
    fn: Callable[[], object], isa: str | None, repeats: int, inner: int
) -> float:
    """timing.median_time of fn on an ISA path (None: the automatic one)."""
    if isa is None:
        os.environ.pop("VLLM_CPU_LORA_ISA", None)
    else:
        os.environ["VLLM_CPU_LORA_ISA"] = isa
    return timing.median_time(fn, repeats, inner)


def _cases(
    tokens_per_adapter: int,
) -> list[tuple[str, Callable[[], None], Callable[[], None]]]:
    """(name, ours, reference) callables for shrink and expand, bf16."""
    gen = torch.Generator().manual_seed(tokens_per_adapter)
    batch = tokens_per_adapter * _ADAPTERS
    x = torch.randn(batch, _HIDDEN, generator=gen).bfloat16()
    lora_a = torch.randn(_ADAPTERS, _RANK, _HIDDEN, generator=gen).bfloat16()
    buf = torch.empty(batch, _RANK)
    y = torch.randn(batch, _RANK, generator=gen).bfloat16()
    lora_b = torch.randn(_ADAPTERS, _HOUT, _RANK, generator=gen).bfloat16()
    out = torch.randn(batch, _HOUT, generator=gen).bfloat16()
    indices = torch.arange(batch) % _ADAPTERS
    return [
        (
            "shrink",
            lambda: ops.bgmv_shrink(x, lora_a, buf, indices, 1.0),
            lambda: reference.bgmv_shrink(x, lora_a, buf, indices, 1.0),
        ),
        (
            "expand",
            lambda: ops.bgmv_expand(y, lora_b, out, indices, True),
            lambda: reference.bgmv_expand(y, lora_b, out, indices, True),
        ),
    ]


def _format_row(row: tuple[int, str, float, float, float]) -> str:
    """A markdown row of the table."""
    tpa, name, ratio, auto, ref = row
    return f"| {tpa} | {name} | {ratio:.2f} | {auto:.2f} | {ref:.0f}x |"


def main() -> None:
    """Times the table's cases, prints it and writes it (--out)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="default: amx.md in the results folder of this CPU",
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the crossover is a per-core question)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if "amx" not in vllm_cpu_lora.supported_isas():
        print(
            "This CPU (or its OS) offers no AMX tiles: supported paths are "
            f"{vllm_cpu_lora.supported_isas()}. Nothing to compare."
        )
        return

    rows = []
    header = (
        "| tokens/adapter | op | AVX512-BF16 / AMX time | auto path / best "
        "| reference / AMX |"
    )
    print(header)
    for tpa in _TOKENS_PER_ADAPTER:
        for name, ours, ref in _cases(tpa):
            for isa in _PATHS:  # Warm-up.
                _median_time(ours, isa, 1, 3)
            inner = max(1, int(2e-3 / _median_time(ours, "amx", 1, 1)))
            # The order rotates: in a fixed one, the path timed right after
            # AVX512-BF16 measured slower shrinks (CHANGELOG, 2026-12-06).
            times = timing.interleave(
                {
                    name: functools.partial(_median_time, ours, isa, 1, inner)
                    for name, isa in (*((p, p) for p in _PATHS), ("auto", None))
                },
                lambda rounds, _: rounds >= args.repeats,
            )
            med = {k: statistics.median(v) for k, v in times.items()}
            ref_time = _median_time(ref, None, 3, 1)
            row = (
                tpa,
                name,
                med["avx512_bf16"] / med["amx"],
                med["auto"] / min(med["amx"], med["avx512_bf16"]),
                ref_time / med["amx"],
            )
            rows.append(row)
            print(_format_row(row))
    os.environ.pop("VLLM_CPU_LORA_ISA", None)

    crossover = {
        op: next(
            (
                tpa
                for tpa, name, ratio, _, _ in rows
                if name == op and ratio > 1
            ),
            None,
        )
        for op in ("shrink", "expand")
    }
    lines = [
        "# AMX vs AVX512-BF16 crossover",
        "",
        f"Date: {datetime.date.today().isoformat()}; "
        f"CPU: {machine.cpu_model()}; "
        f"torch {torch.__version__}; threads: {torch.get_num_threads()}; "
        f"paths: {vllm_cpu_lora.supported_isas()}.",
        "",
        f"bf16, H={_HIDDEN}, Hout={_HOUT}, rank {_RANK}, {_ADAPTERS} adapters, "
        "tokens spread evenly over the adapters (bgmv). Ratios of medians "
        "measured side by side in one process; >1 in the third column means "
        "AMX is faster (swapped-operand tiles below AmxMinTokens tokens per "
        "adapter, regular tiles from there). 'auto path / best' is the "
        "per-call rule (AmxMinTokens, AmxSwapMinTokens) against the faster "
        "of the two forced paths (1.00 = the rule picked the winner).",
        "",
        header,
        "|---|---|---|---|---|",
        *[_format_row(row) for row in rows],
        "",
        "First tokens-per-adapter count where AMX wins: "
        + ", ".join(f"{op}: {tpa}" for op, tpa in crossover.items()),
        "",
    ]
    out = args.out or common.default_out_dir() / "amx.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
