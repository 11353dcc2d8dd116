"""The end-to-end benchmark's configurations, target and figures.

What is compared (``CONFIGS``) and against which target, and from the raw
rounds the summary, its tables and the plot.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import textwrap
from typing import TYPE_CHECKING, Any

from benchmarks import report

if TYPE_CHECKING:
    from benchmarks.vllm_e2e import Settings

TARGET_RATIO = 0.95
VLLM_WRAPPER = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"
OUR_WRAPPER = "vllm_cpu_lora.punica.PunicaWrapperCPULoRA"
# The figure vLLM's CPU-LoRA pull request reported for stock CPU vLLM on
# Llama-2-7B with a rank-8 adapter, 2 prompts x 128 tokens.
PR_TOKENS_PER_S = 1.13
# Per round figures (vllm_e2e._rates) summarized: key, title.
FIGURES = (
    ("decode_tok_s", "decode"),
    ("prefill_tok_s", "prefill"),
    ("generate_tok_s", "generate"),
)
# The ratios of decode tokens/s shown side by side: (numerator, denominator).
RATIOS = (
    ("ours", "no-lora"),
    ("vllm-torch", "no-lora"),
    ("ours", "vllm-torch"),
)


@dataclasses.dataclass(frozen=True)
class Config:
    """One served configuration."""

    name: str
    title: str
    enable_lora: bool
    disable_plugin: bool
    wrapper: str | None
    skip_kernels: bool = False


CONFIGS = (
    Config("no-lora", "no LoRA", False, True, None),
    Config(
        "vllm-torch",
        "LoRA, vLLM's torch wrapper",
        True,
        True,
        VLLM_WRAPPER,
    ),
    Config("ours", "LoRA, vllm_cpu_lora", True, False, OUR_WRAPPER),
    # A diagnostic, not a way to serve: everything of "ours" but the LoRA
    # kernels' work (vllm_child.worker_skip_kernels), so that its gap to
    # no-LoRA is what vLLM's LoRA layers cost around any kernels.
    Config(
        "no-kernels",
        "LoRA, vllm_cpu_lora, kernels skipped",
        True,
        False,
        OUR_WRAPPER,
        skip_kernels=True,
    ),
)


def run_configs(result: dict[str, Any]) -> list[Config]:
    """The configurations a run measured, in CONFIGS order."""
    return [c for c in CONFIGS if c.name in result["rounds"][0]]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios to no-LoRA and their spread over rounds."""
    rounds = result["rounds"]
    base = "no-lora"
    summary: dict[str, Any] = {}
    for config in run_configs(result):
        s: dict[str, Any] = {}
        for key, _ in FIGURES:
            rates = [row[config.name][key] for row in rounds]
            s[f"{key}_median"] = statistics.median(rates)
            s[f"{key}_min"] = min(rates)
            s[f"{key}_max"] = max(rates)
        paired = [
            row[config.name]["decode_tok_s"] / row[base]["decode_tok_s"]
            for row in rounds
        ]
        s["paired_ratio_min"] = min(paired)
        s["paired_ratio_max"] = max(paired)
        summary[config.name] = s
    profiles = result.get("profiles") or {}
    for name, s in summary.items():
        for key, _ in FIGURES:
            s[f"{key}_ratio_to_no_lora"] = (
                s[f"{key}_median"] / summary[base][f"{key}_median"]
            )
        s["ratio_to_no_lora"] = s["decode_tok_s_ratio_to_no_lora"]
        s["best_ratio_to_no_lora"] = (
            s["decode_tok_s_max"] / summary[base]["decode_tok_s_max"]
        )
        if name in profiles and base in profiles:
            prof = profiles[name]
            s["profile_time_ratio_to_no_lora"] = (
                profiles[base]["total_self_us"] / prof["total_self_us"]
            )
            s["profile_vllm_cpu_lora_share"] = prof["vllm_cpu_lora_share"]
    return summary


def _ratio(summary: dict[str, Any], num: str, den: str, key: str) -> float:
    return summary[num][f"{key}_median"] / summary[den][f"{key}_median"]


def ratios_table(summary: dict[str, Any]) -> list[str]:
    """Markdown: the side-by-side ratios of medians, decode and prefill."""
    lines = [
        "| ratio | decode | prefill | per-round decode ratios |",
        "|---|---:|---:|---:|",
    ]
    for num, den in RATIOS:
        if num not in summary or den not in summary:
            continue
        spread = ""
        if den == "no-lora":
            s = summary[num]
            spread = f"{s['paired_ratio_min']:.3f}..{s['paired_ratio_max']:.3f}"
        lines.append(
            f"| {num} / {den} | "
            f"{_ratio(summary, num, den, 'decode_tok_s'):.3f} | "
            f"{_ratio(summary, num, den, 'prefill_tok_s'):.3f} | {spread} |"
        )
    return lines


def results_table(
    result: dict[str, Any],
    summary: dict[str, Any],
    batch: int,
    markdown: bool,
) -> list[str]:
    """One row per configuration: tokens/s and the ratio to no-LoRA."""
    head = [
        "config",
        "mode",
        "decode tok/s (median)",
        "min..max",
        "ms/step",
        "decode ratio to no-LoRA",
        "prefill tok/s",
        "prefill ratio",
        "generate tok/s",
    ]
    rows = []
    for config in run_configs(result):
        s = summary[config.name]
        mode = result["configs"][config.name]["compilation_mode"]
        rows.append(
            [
                config.title,
                "compiled" if mode == "DYNAMO_TRACE_ONCE" else str(mode),
                f"{s['decode_tok_s_median']:.2f}",
                f"{s['decode_tok_s_min']:.2f}..{s['decode_tok_s_max']:.2f}",
                f"{1000 * batch / s['decode_tok_s_median']:.0f}",
                f"{s['ratio_to_no_lora']:.3f}",
                f"{s['prefill_tok_s_median']:.1f}",
                f"{s['prefill_tok_s_ratio_to_no_lora']:.3f}",
                f"{s['generate_tok_s_median']:.2f}",
            ]
        )
    return report.table(head, rows, markdown, left=0, align_right=True)


def target(summary: dict[str, Any]) -> tuple[bool, str]:
    """Whether ours reaches TARGET_RATIO of no-LoRA, and the line saying so."""
    ours = summary["ours"]["ratio_to_no_lora"]
    theirs = summary["vllm-torch"]["ratio_to_no_lora"]
    ok = ours >= TARGET_RATIO
    line = (
        f"{'PASS' if ok else 'FAIL'}  adapters through vllm_cpu_lora reach "
        f"{100 * ours:.1f}% of the no-LoRA decode tokens/s (target >= "
        f"{100 * TARGET_RATIO:.0f}%; vLLM's torch wrapper: "
        f"{100 * theirs:.1f}%)"
    )
    if "no-kernels" in summary:
        floor = summary["no-kernels"]["ratio_to_no_lora"]
        line += (
            f"\n      with the kernels skipped, vLLM's LoRA layers alone "
            f"reach {100 * floor:.1f}%"
        )
    return ok, line


def write_plot(
    path: pathlib.Path,
    settings: Settings,
    result: dict[str, Any],
    summary: dict[str, Any],
) -> None:
    """Decode tokens/s per configuration, rounds as dots."""
    plt = report.pyplot()
    configs = run_configs(result)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    xs = range(len(configs))
    meds = [summary[c.name]["decode_tok_s_median"] for c in configs]
    colors = {"no-lora": "0.55", "vllm-torch": "C1", "ours": "C0"}
    ax.bar(xs, meds, color=[colors.get(c.name, "C2") for c in configs])
    for i, c in enumerate(configs):
        pts = [row[c.name]["decode_tok_s"] for row in result["rounds"]]
        ax.scatter([i] * len(pts), pts, color="k", s=10, zorder=3)
        ratio = summary[c.name]["ratio_to_no_lora"]
        ax.text(
            i,
            max(meds[i], *pts) * 1.01,
            f"{meds[i]:.2f}\n({100 * ratio:.1f}%)",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    base = summary["no-lora"]["decode_tok_s_median"]
    ax.axhline(
        TARGET_RATIO * base,
        color="gray",
        lw=0.8,
        ls="--",
        label=f"target: {100 * TARGET_RATIO:.0f}% of no-LoRA",
    )
    ax.set_xticks(list(xs))
    ax.set_xticklabels(
        [
            textwrap.fill(
                f"{c.title} ({result['configs'][c.name]['compilation_mode']})",
                24,
            )
            for c in configs
        ],
        fontsize=8,
    )
    ax.set_ylabel("decode tokens/s (median; dots: rounds)")
    ax.set_ylim(0, max(meds) * 1.25)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        f"CPU vLLM {result['vllm']}, {settings.model} "
        f"({settings.num_layers} layers), batch {settings.batch}, bf16"
        + (", eager" if settings.enforce_eager else ", vLLM defaults"),
        fontsize=10,
    )
    report.save(fig, path)
