"""The kernel benchmark's summary, targets and outputs (ops.md, .json, .png).

The founders' targets: over the core cases (bf16, a random adapter per
token, Hout 4096 / 11008), bgmv >= 60x the reference and >= 8x grouped
torch, sgmv >= 100x the reference and, on all threads, >= 75% of the bf16
peak; a B=1 call costs <= 3 us. Those of #16 are in `kernels_targets`.

`python -m benchmarks.kernels_report DIR` writes DIR's ops.md and ops.png
again from its ops.json, for a change of the report alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import kernels_targets, machine, report
from benchmarks.report import Target

_BGMV_VS_REFERENCE = 60.0
_BGMV_VS_GROUPED = 8.0
_FIXED_COST_US = 3.0
_SGMV_VS_REFERENCE = 100.0
_SGMV_PEAK_FRACTION = 0.75


@dataclasses.dataclass
class Run:
    """Everything one run of the kernel benchmark measured."""

    machine: dict[str, Any]
    limits: dict[int, machine.Limits]
    fixed: dict[int, dict[str, float]]
    results: list[dict[str, Any]]
    failures: list[str]
    quick: bool
    all_threads: int
    passes: int
    elapsed_s: float = 0.0

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> Run:
        """The run an ops.json holds (as `finish` wrote it)."""
        return cls(
            machine=saved["machine"],
            limits={
                int(t): machine.Limits(**v) for t, v in saved["limits"].items()
            },
            fixed={int(t): v for t, v in saved["fixed_cost_us"].items()},
            results=saved["results"],
            failures=saved["correctness_failures"],
            quick=saved["quick"],
            all_threads=saved["machine"]["threads_all"],
            passes=saved["passes"],
            elapsed_s=saved["elapsed_s"],
        )


def _bf16_peak_name(run: Run) -> str:
    """The peak of the all-threads 'of bf16 peak' target (vdpbf16ps if any)."""
    lim = run.limits.get(run.all_threads)
    isa = run.machine["isa_path"]
    return lim.bf16_peak(isa)[1] if lim else "vdpbf16ps"


def summarize(run: Run) -> tuple[dict[str, dict[str, float]], list[Target]]:
    """Geomeans per thread count and PASS/FAIL lines for the targets."""
    results, fixed, all_threads = run.results, run.fixed, run.all_threads
    geomean, peak_name = report.geomean, _bf16_peak_name(run)
    summary: dict[str, dict[str, float]] = {}
    targets: list[Target] = []
    issue16: list[Target] = []
    for threads in sorted({r["threads"] for r in results}, reverse=True):
        rows = [r for r in results if r["threads"] == threads and r.get("core")]
        bgmv = [r for r in rows if r["family"] == "bgmv"]
        sgmv = [r for r in rows if r["family"] == "sgmv"]
        s = {
            "bgmv_vs_reference": geomean(
                r["speedup_vs_reference"] for r in bgmv
            ),
            "bgmv_vs_reference_at_bound": (
                kernels_targets.vs_reference_at_bound(bgmv)
            ),
            "bgmv_vs_grouped": geomean(r["speedup_vs_grouped"] for r in bgmv),
            "bgmv_fraction_of_bound": geomean(
                r["fraction_of_bound"] for r in bgmv
            ),
            "sgmv_vs_reference": geomean(
                r["speedup_vs_reference"] for r in sgmv
            ),
            "sgmv_vs_grouped": geomean(r["speedup_vs_grouped"] for r in sgmv),
            "sgmv_fraction_of_bf16_peak": geomean(
                r["fraction_of_bf16_peak"] for r in sgmv
            ),
            "fixed_cost_us": fixed.get(threads, {}).get("ops", math.nan),
        }
        summary[str(threads)] = s
        tag = f"[{threads} thread{'s' if threads > 1 else ''}]"
        checks = [
            (
                "bgmv geomean speed-up over reference",
                "bgmv_vs_reference",
                ">=",
                _BGMV_VS_REFERENCE,
                "x",
            ),
            (
                "bgmv geomean speed-up over grouped torch",
                "bgmv_vs_grouped",
                ">=",
                _BGMV_VS_GROUPED,
                "x",
            ),
            (
                "B=1 fixed cost, us",
                "fixed_cost_us",
                "<=",
                _FIXED_COST_US,
                " us",
            ),
            (
                "sgmv geomean speed-up over reference",
                "sgmv_vs_reference",
                ">=",
                _SGMV_VS_REFERENCE,
                "x",
            ),
        ]
        if threads == all_threads:
            checks.append(
                (
                    f"sgmv geomean fraction of {peak_name} peak",
                    "sgmv_fraction_of_bf16_peak",
                    ">=",
                    _SGMV_PEAK_FRACTION,
                    "",
                )
            )
        for name, key, sign, limit, unit in checks:
            v = s[key]
            if math.isnan(v):
                targets.append((f"{tag} {name}", None, "no cases"))
                continue
            ok = v >= limit if sign == ">=" else v <= limit
            detail = f"{report.num(v)} ({sign} {limit:g}{unit})"
            if key == "bgmv_vs_reference":
                at_bound = s["bgmv_vs_reference_at_bound"]
                detail += f"; {report.num(at_bound)}x at the bound"
            targets.append((f"{tag} {name}", ok, detail))
        issue16 += kernels_targets.issue16_targets(
            tag, [r for r in results if r["threads"] == threads], s, peak_name
        )
    if str(all_threads) not in summary:
        targets.append(
            (
                f"[{all_threads} threads] sgmv geomean fraction of {peak_name} "
                "peak",
                None,
                "not run (needs all threads)",
            )
        )
    return summary, targets + issue16


def results_table(results: list[dict[str, Any]], markdown: bool) -> list[str]:
    """One row per case and thread count: the ratios and the bound."""
    head = (
        "threads",
        "case",
        "vs reference",
        "vs grouped",
        "grouped vs ref",
        "of bound",
        "bound by",
        "of bf16 peak",
    )
    rows = [
        (
            str(r["threads"]),
            r["label"],
            f"{r['speedup_vs_reference']:.1f}x",
            f"{r['speedup_vs_grouped']:.2f}x",
            f"{r['grouped_vs_reference']:.1f}x",
            f"{100 * r['fraction_of_bound']:.0f}%",
            f"{r['bandwidth_level']} {r['bound_by']}",
            f"{100 * r['fraction_of_bf16_peak']:.1f}%",
        )
        for r in results
    ]
    return report.table(head, rows, markdown)


def _peaks_line(run: Run) -> str:
    """Which compute peak bounds the run's ISA path, and the bf16 peak."""
    isa = run.machine["isa_path"]
    lim = next(iter(run.limits.values()), None)
    if lim is None:
        return ""
    bound, bf16 = lim.peak_for(isa)[1], lim.bf16_peak(isa)[1]
    widened = " (bf16 widened to fp32)" if bf16 == "fp32 FMA" else ""
    return (
        f"- On this run's ISA path `{isa}` the compute peak of the bound is "
        f"the {bound} peak (fp32 and fp16 cases: fp32 FMA); 'of bf16 peak' "
        f"uses the {bf16} peak{widened}. "
        f"Micro-kernels: {lim.isa or 'none (no AVX2 or AVX-512)'}."
    )


def markdown_lines(
    run: Run, summary: dict[str, dict[str, float]], targets: list[Target]
) -> list[str]:
    """ops.md."""
    m = run.machine
    lines = [
        "# vllm_cpu_lora kernel benchmark (ops)",
        "",
        "Generated by `python -m benchmarks.kernels"
        + (" --quick" if run.quick else "")
        + "`"
        + f" on {m['date']} in {run.elapsed_s:.0f} s.",
        "",
        "## Machine",
        "",
        *report.cpu_lines(m, supported=True),
        f"- 1-minute load average {m['load_average_start']:.1f} at the start, "
        f"{m['load_average_end']:.1f} at the end: other work on the cores "
        "makes the figures noisy, and multi-threaded ones unreliable (a "
        "parallel region waits for its last thread to be scheduled).",
        "",
        "## Measured limits",
        "",
        "Micro-kernels compiled at run time (best of several runs; "
        "`benchmarks/micro/micro_kernels.cpp`): AVX-512 loads (AVX2 loads "
        "on a CPU without AVX-512 or on the `avx2` path) summed for read "
        "bandwidth, each thread on its own slice; a register loop of "
        "`vdpbf16ps` (64 flop each) or "
        "`vfmadd231ps` (32 flop on 512-bit registers with 24 independent "
        "accumulators per thread, 16 flop on AVX2's 256-bit ones with 12) "
        "for peak; where the CPU has AMX, `tdpbf16ps` on four independent C "
        "tiles.",
        "",
        *machine.limits_table(run.limits),
        "",
        "## Method",
        "",
        "- ours = `vllm_cpu_lora.ops`; reference = `vllm_cpu_lora.reference` "
        "(vLLM's per-token gather); grouped = pure torch in "
        "`benchmarks/baselines.py` (tokens grouped by adapter, one "
        "`torch.mm` per adapter in a Python loop).",
        "- Interleaved rounds, order rotating, medians over rounds; each "
        "sample follows at least 5 ms of untimed calls of the same "
        "implementation (its steady state); every case checked once against "
        f"the reference first. Each case's rounds are spread over "
        f"{run.passes} pass(es) through all cases, so that a slow spell of "
        "the shared machine, seconds long, falls on part of many cases' "
        "rounds rather than on all of a few cases' rounds.",
        "- bgmv (decode): x bf16 [T, 4096], A bf16 [L, r, 4096] -> fp32 "
        "[T, r]; expand y fp32 [T, r], B bf16 [L, N, r] -> bf16 [T, N] with "
        "add_inputs; a random adapter per token.",
        "- sgmv (prefill): 2048 tokens in 4 segments of 512, one adapter "
        "each, bf16 activations both ways, add_inputs on expand.",
        "- Cases marked `fp32` or `fp16` take that dtype for activations and "
        "weights (the fp32 buffer between a decode shrink and expand stays; "
        "fp32 cases are fp32 throughout). torch multiplies fp16 on a CPU "
        "without AVX512-FP16 far slower than bf16 or fp32, which the fp16 "
        "rows' 'vs grouped' shows; there the `fp32` rows' grouped times "
        "bound what upcasting to fp32 would cost.",
        "- Bound = max(bytes / bandwidth, flops / peak) with the thread "
        "count of the run, peak being the largest of the peaks the ISA path "
        "can use (AMX: the vdpbf16ps, fp32 FMA and AMX peaks; AVX512-BF16: "
        "vdpbf16ps and fp32 FMA; AVX-512, AVX2: fp32 FMA, bf16 being "
        "widened); fp32 and fp16 cases the fp32 FMA peak only, which alone "
        "multiplies them exactly. Bytes: the weights of the adapters in use, "
        "the inputs, the output (read and written for expand). **Bandwidth "
        "is in-cache**: the weights are hot (decode reuses them every step), "
        "so a case whose bytes fit in 3/4 of the threads' L2 uses the L2 "
        "figure, else the L3 figure (DRAM only beyond half the L3). "
        "'of bound' = bound time / our time (100% = at the bound).",
        "- 'of bf16 peak' = flops / our time / measured vdpbf16ps peak "
        "(the fp32 FMA peak on a path without vdpbf16ps; a kernel on the AMX "
        "path can pass 100%).",
        _peaks_line(run),
        "",
        "## Fixed cost of a B=1 call",
        "",
        "Median time of a tiny `bgmv_shrink` (B=1, r=16, H=16, L=1), through "
        "`vllm_cpu_lora.ops` and straight through `torch.ops` (target <= "
        f"{_FIXED_COST_US:g} us for ops):",
        "",
        "| threads | ops, us | torch.ops, us |",
        "|---|---|---|",
    ]
    for t in sorted(run.fixed, reverse=True):
        f = run.fixed[t]
        lines.append(f"| {t} | {f['ops']:.2f} | {f['torch_ops']:.2f} |")
    lines += ["", "## Results (ratios)", "", *results_table(run.results, True)]
    lines += [
        "",
        "## Summary (geomeans over cases)",
        "",
        "Over the targets' grid only (bf16, a random adapter per token, "
        "ranks 8 / 16 / 64, Hout 4096 / 11008); the cases marked `shared` "
        "(every token on one adapter), `fp32`, `fp16`, N1024 / N14336 "
        "(Llama-3-8B) and rank 1 (vLLM's smallest `max_lora_rank`) are in "
        "the table above, not in these figures.",
        "",
        *report.summary_table(summary),
        "",
        "## Targets",
        "",
        "The founders' first, then #16's: its counts over the bf16 and fp32 "
        "cases, its geomeans over the grid. 'At the bound' is the geomean "
        "over the grid of the reference's time over each case's bound (our "
        "time where shorter): what no kernel can pass against the reference "
        "on this machine and path.",
        "",
        *report.target_block(targets, run.failures),
    ]
    return lines


def write_plot(path: pathlib.Path, results: list[dict[str, Any]]) -> None:
    """ops.png: speed-up over the reference and fraction of the bound."""
    plt = report.pyplot()
    labels = list(dict.fromkeys(r["label"] for r in results))
    pos = {label: i for i, label in enumerate(labels)}
    fig, axes = plt.subplots(
        2, 1, figsize=(max(10, 0.14 * len(labels) + 3), 9), sharex=True
    )
    markers: dict[int, str] = {}
    for threads in sorted({r["threads"] for r in results}, reverse=True):
        markers[threads] = "o" if not markers else "^"
        rows = [r for r in results if r["threads"] == threads]
        for op, color in report.OP_COLORS.items():
            sel = [r for r in rows if r["op"] == op]
            if not sel:
                continue
            xs = [pos[r["label"]] for r in sel]
            style = {"s": 14, "color": color, "marker": markers[threads]}
            axes[0].scatter(
                xs,
                [r["speedup_vs_reference"] for r in sel],
                label=f"{op}, {threads} thr",
                **style,
            )
            axes[1].scatter(
                xs, [100 * r["fraction_of_bound"] for r in sel], **style
            )
    axes[0].set_yscale("log")
    axes[0].set_ylabel("speed-up over reference (x)")
    axes[0].axhline(_BGMV_VS_REFERENCE, color="gray", lw=0.6, ls="--")
    axes[0].axhline(_SGMV_VS_REFERENCE, color="gray", lw=0.6, ls=":")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0].grid(True, which="both", lw=0.3)
    axes[1].set_ylabel("fraction of bound (%)")
    axes[1].axhline(100, color="gray", lw=0.6, ls="--")
    axes[1].grid(True, lw=0.3)
    axes[1].set_xticks(range(len(labels)))
    axes[1].set_xticklabels(labels, rotation=90, fontsize=5)
    fig.suptitle("vllm_cpu_lora ops: ratios measured side by side")
    report.save(fig, path)


def finish(run: Run, out_dir: pathlib.Path) -> None:
    """Prints the table and targets; writes ops.json, ops.md and ops.png."""
    summary, targets = summarize(run)
    print()
    print("\n".join(results_table(run.results, markdown=False)))
    print()
    print("\n".join(report.target_lines(targets)))
    for f in run.failures:
        print(f"FAIL  correctness: {f}")
    print(
        f"\n{len(run.results)} cases in {run.elapsed_s:.0f} s; results in "
        f"{out_dir}"
    )
    report.write_json(
        out_dir / "ops.json",
        {
            "machine": run.machine,
            "quick": run.quick,
            "passes": run.passes,
            "elapsed_s": run.elapsed_s,
            "limits": {
                str(t): dataclasses.asdict(v) for t, v in run.limits.items()
            },
            "fixed_cost_us": {str(t): v for t, v in run.fixed.items()},
            "results": run.results,
            "summary": summary,
            "targets": report.targets_json(targets),
            "correctness_failures": run.failures,
        },
    )
    report.write_markdown(
        out_dir / "ops.md", markdown_lines(run, summary, targets)
    )
    if run.results:
        write_plot(out_dir / "ops.png", run.results)


def main(argv: Sequence[str] | None = None) -> int:
    """Writes a results folder's reports again from its ops.json."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir", type=pathlib.Path)
    out_dir = parser.parse_args(argv).out_dir
    saved = json.loads((out_dir / "ops.json").read_text())
    finish(Run.from_json(saved), out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
