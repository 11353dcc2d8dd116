"""The end-to-end benchmark's configurations, target and report.

What is compared (``CONFIGS``) and against which target, and from the raw
rounds the summary, the tables and the outputs (vllm_e2e.md, .json, .png).
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
NUM_ADAPTERS = 4
LORA_RANK = 16


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
        "4 adapters, vLLM's torch wrapper",
        True,
        True,
        VLLM_WRAPPER,
    ),
    Config("ours", "4 adapters, vllm_cpu_lora", True, False, OUR_WRAPPER),
    # A diagnostic, not a way to serve: everything of "ours" but the LoRA
    # kernels' work (vllm_child.worker_skip_kernels), so that its gap to
    # no-LoRA is what vLLM's LoRA layers cost around any kernels.
    Config(
        "no-kernels",
        "4 adapters, vllm_cpu_lora, kernels skipped",
        True,
        False,
        OUR_WRAPPER,
        skip_kernels=True,
    ),
)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios to no-LoRA and their spread over rounds."""
    rounds = result["rounds"]
    base = "no-lora"
    summary: dict[str, Any] = {}
    for config in CONFIGS:
        rates = [row[config.name]["decode_tok_s"] for row in rounds]
        paired = [
            row[config.name]["decode_tok_s"] / row[base]["decode_tok_s"]
            for row in rounds
        ]
        med = statistics.median(rates)
        summary[config.name] = {
            "decode_tok_s_median": med,
            "decode_tok_s_min": min(rates),
            "decode_tok_s_max": max(rates),
            "paired_ratio_min": min(paired),
            "paired_ratio_max": max(paired),
        }
    base_med = summary[base]["decode_tok_s_median"]
    base_best = summary[base]["decode_tok_s_max"]
    profiles = result.get("profiles") or {}
    for config in CONFIGS:
        s = summary[config.name]
        s["ratio_to_no_lora"] = s["decode_tok_s_median"] / base_med
        s["best_ratio_to_no_lora"] = s["decode_tok_s_max"] / base_best
        if config.name in profiles and base in profiles:
            prof = profiles[config.name]
            s["profile_time_ratio_to_no_lora"] = (
                profiles[base]["total_self_us"] / prof["total_self_us"]
            )
            s["profile_vllm_cpu_lora_share"] = prof["vllm_cpu_lora_share"]
    return summary


def results_table(
    summary: dict[str, Any], batch: int, markdown: bool
) -> list[str]:
    """One row per configuration: decode tokens/s and its ratio to no-LoRA."""
    head = [
        "config",
        "decode tok/s (median)",
        "min..max",
        "ms/step",
        "ratio to no-LoRA",
        "per-round ratios",
        "ratio of bests",
    ]
    rows = []
    for config in CONFIGS:
        s = summary[config.name]
        rows.append(
            [
                config.title,
                f"{s['decode_tok_s_median']:.1f}",
                f"{s['decode_tok_s_min']:.1f}..{s['decode_tok_s_max']:.1f}",
                f"{1000 * batch / s['decode_tok_s_median']:.1f}",
                f"{s['ratio_to_no_lora']:.3f}",
                f"{s['paired_ratio_min']:.3f}..{s['paired_ratio_max']:.3f}",
                f"{s['best_ratio_to_no_lora']:.3f}",
            ]
        )
    return report.table(head, rows, markdown, left=0, align_right=True)


def target(summary: dict[str, Any]) -> tuple[bool, str]:
    """Whether ours reaches TARGET_RATIO of no-LoRA, and the line saying so."""
    ours = summary["ours"]["ratio_to_no_lora"]
    theirs = summary["vllm-torch"]["ratio_to_no_lora"]
    ok = ours >= TARGET_RATIO
    line = (
        f"{'PASS' if ok else 'FAIL'}  4 adapters through vllm_cpu_lora reach "
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


def profile_table(profile: dict[str, Any], top: int) -> list[str]:
    """Markdown: the top ops of a profile by self time."""
    lines = [
        "| op | calls | self ms | share of self time |",
        "|---|---:|---:|---:|",
    ]
    for op in profile["ops"][:top]:
        lines.append(
            f"| `{op['name']}` | {op['calls']} | {op['self_us'] / 1000:.1f} "
            f"| {100 * op['share']:.1f}% |"
        )
    return lines


def markdown_lines(
    m: dict[str, Any],
    settings: Settings,
    result: dict[str, Any],
    summary: dict[str, Any],
    quick: bool,
    elapsed: float,
) -> list[str]:
    """vllm_e2e.md."""
    _, target_line = target(summary)
    problems = {k: v for k, v in result["routing_problems"].items() if v}
    lines = [
        "# CPU vLLM end to end: decode tokens/s with and without LoRA",
        "",
        "Generated by `python -m benchmarks.vllm_e2e"
        + (" --quick" if quick else "")
        + f"` on {m['date']} in {elapsed:.0f} s (vLLM {result['vllm']}).",
        "",
        "## Machine",
        "",
        *report.cpu_lines(m, threads=False, caches=False),
        f"- 1-minute load average {m['load_average_start']:.1f} at the start, "
        f"{m['load_average_end']:.1f} at the end (a shared machine: other "
        "work on the cores makes the figures noisy).",
        "",
        "## Model and workload",
        "",
        f"- Random-weight Llama, bf16, Llama-2-7B layer shapes (hidden 4096, "
        f"MLP 11008, 32 heads, 32 KV heads), {settings.num_layers} "
        f"layer(s), vocabulary {result['vocab_size']} (the demo's byte-level "
        "BPE tokenizer: the LM head is negligible, as in a 32-layer model "
        "where it is a few percent).",
        f"- {NUM_ADAPTERS} random PEFT LoRA adapters, rank {LORA_RANK} on q, "
        "k, v, o, gate, up and down (non-zero A and B); "
        + (
            "requests assigned round robin, so neighbouring tokens in a "
            "batch use different adapters."
            if settings.assign == "round-robin"
            else "requests grouped by adapter (4 runs of equal length)."
        ),
        f"- One batched offline `LLM.generate` of {settings.batch} prompts "
        f"({min(result['prompt_tokens'])}..{max(result['prompt_tokens'])} "
        f"tokens), greedy, `ignore_eos`, {settings.max_tokens} output "
        "tokens each.",
        "- vLLM: `dtype=bfloat16`, `enforce_eager=True`, prefix caching off, "
        "`max_model_len=512`, `VLLM_CPU_KVCACHE_SPACE="
        f"{result['kv_cache_space']}` GiB, default thread binding; LoRA "
        f"configs: `enable_lora=True`, `max_loras={NUM_ADAPTERS}`, "
        f"`max_lora_rank={LORA_RANK}`.",
        "",
        "## Method",
        "",
        "- Each configuration is served by its own long-lived vLLM child "
        "process (`enable_lora=False`; `VLLM_CPU_LORA_DISABLE=1` for vLLM's "
        "own `PunicaWrapperCPU`; the plug-in active for ours). Each child "
        "reports the Punica wrapper its worker built and our op counters.",
        "- 'kernels skipped' is a diagnostic: ours with every kernel call "
        "replaced by a no-op in the worker (its outputs are the base "
        "model's), so its gap to no-LoRA is what vLLM's LoRA layers cost "
        "(slicing, buffers, metadata, Python) whatever the kernels.",
        "- Decode tokens/s = B x (N - 1) / (t_N - t_1): t_N is a generate "
        "with `max_tokens=N`, t_1 one with `max_tokens=1` right before it, "
        "so prefill, the first token and per-call overhead cancel.",
        "- vLLM's CPU model runner sends every step, decode included, "
        "through the Punica wrapper's prefill (sgmv) ops, one segment per "
        "run of requests with the same adapter; the logits LoRA goes "
        "through bgmv.",
        f"- Warm-up in each child (1 and {settings.warmup_tokens} tokens), "
        f"then {settings.rounds} round(s), the configurations taking turns "
        "in rotating order; figures are medians over rounds, and "
        "'per-round ratios' is the range of each round's ratio to that "
        "round's no-LoRA figure (a measure of the noise).",
        "",
        "## Routing check",
        "",
    ]
    for config in CONFIGS:
        c = result["configs"][config.name]
        calls = c.get("op_calls_total") or c["op_calls_after_warmup"]
        status = (
            "OK"
            if not result["routing_problems"][config.name]
            else (
                "PROBLEM: " + "; ".join(result["routing_problems"][config.name])
            )
        )
        lines.append(
            f"- {config.title}: wrapper "
            f"{', '.join(f'`{w}`' for w in c['wrappers']) or 'none'}; "
            f"vllm_cpu_lora op calls: "
            + (
                ", ".join(f"{k} {v}" for k, v in sorted(calls.items()))
                or "none"
            )
            + f" ({status})"
        )
    threads = result["configs"]["ours"]["worker_threads"]
    lines += [
        "",
        f"vLLM's worker runs {threads['torch_threads']} torch thread(s) on "
        f"CPU(s) {threads['affinity']}. From the log of one child (ours):",
        "",
        "```",
        *result["configs"]["ours"]["log_facts"],
        "```",
        "",
        "## Results",
        "",
    ]
    lines += results_table(summary, settings.batch, markdown=True)
    lines += ["", "Per round (decode tokens/s):", ""]
    names = [c.name for c in CONFIGS]
    lines.append("| round | " + " | ".join(names) + " |")
    lines.append("|---|" + "---:|" * len(names))
    for i, row in enumerate(result["rounds"]):
        lines.append(
            f"| {i + 1} | "
            + " | ".join(f"{row[n]['decode_tok_s']:.1f}" for n in names)
            + " |"
        )
    lines += ["", "## Target", "", "```", target_line]
    for name, p in problems.items():
        lines.append(f"FAIL  routing of {name}: {'; '.join(p)}")
    lines += ["```", ""]
    if result.get("profiles"):
        lines += [
            "## Where the time goes (torch.profiler in vLLM's worker)",
            "",
            f"After the rounds, one more {settings.max_tokens}-token "
            "generate per configuration under torch.profiler (CPU ops in "
            "vLLM's worker process, prefill included; the profiler adds "
            "overhead of its own). A single run each, so noisy too, but "
            "op by op. Top ops by self time:",
            "",
        ]
        for name, prof in result["profiles"].items():
            title = next(c.title for c in CONFIGS if c.name == name)
            s = summary[name]
            lines += [
                f"### {title}",
                "",
                f"Total self time {prof['total_self_us'] / 1e6:.2f} s"
                + (
                    f" (no-LoRA's total / this total = "
                    f"{s['profile_time_ratio_to_no_lora']:.3f}; "
                    f"vllm_cpu_lora ops: "
                    f"{100 * s['profile_vllm_cpu_lora_share']:.1f}%)"
                    if "profile_time_ratio_to_no_lora" in s
                    else ""
                )
                + ".",
                "",
                *profile_table(prof, 15),
                "",
            ]
    return lines


def write_plot(
    path: pathlib.Path, result: dict[str, Any], summary: dict[str, Any]
) -> None:
    """vllm_e2e.png: decode tokens/s per configuration, rounds as dots."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.6))
    xs = range(len(CONFIGS))
    meds = [summary[c.name]["decode_tok_s_median"] for c in CONFIGS]
    colors = ["0.55", "C1", "C0", "C2"]
    ax.bar(xs, meds, color=colors, width=0.6)
    for i, c in enumerate(CONFIGS):
        pts = [row[c.name]["decode_tok_s"] for row in result["rounds"]]
        ax.scatter([i] * len(pts), pts, color="k", s=10, zorder=3)
        ratio = summary[c.name]["ratio_to_no_lora"]
        ax.text(
            i,
            max(meds[i], *pts) * 1.01,
            f"{meds[i]:.1f}\n({100 * ratio:.1f}%)",
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
        [textwrap.fill(c.title, 22) for c in CONFIGS], fontsize=8
    )
    ax.set_ylabel("decode tokens/s (median; dots: rounds)")
    ax.set_ylim(0, max(meds) * 1.25)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        f"CPU vLLM, Llama-7B-shaped layers x{result['settings']['num_layers']}"
        f", batch {result['settings']['batch']}, bf16",
        fontsize=10,
    )
    report.save(fig, path)


def finish(
    info: dict[str, Any],
    settings: Settings,
    result: dict[str, Any],
    model: dict[str, Any],
    quick: bool,
    elapsed: float,
    out_dir: pathlib.Path,
) -> bool:
    """Prints the summary; writes vllm_e2e.json, .md and .png.

    Returns:
        Whether the target is met and every child used the wrapper meant.
    """
    summary = summarize(result)
    ok, target_line = target(summary)
    problems = {k: v for k, v in result["routing_problems"].items() if v}

    print()
    print("\n".join(results_table(summary, settings.batch, markdown=False)))
    print()
    print(target_line)
    for name, p in problems.items():
        print(f"FAIL  routing of {name}: {'; '.join(p)}")
    for name, prof in result.get("profiles", {}).items():
        print(f"\nTop ops by self time, {name}:")
        for op in prof["ops"][:10]:
            print(
                f"  {100 * op['share']:5.1f}%  {op['self_us'] / 1000:9.1f} ms"
                f"  {op['calls']:7d}  {op['name']}"
            )
    print(f"\nDone in {elapsed:.0f} s; results in {out_dir}")

    report.write_json(
        out_dir / "vllm_e2e.json",
        {
            "machine": info,
            "quick": quick,
            "elapsed_s": elapsed,
            "model": model,
            **{k: v for k, v in result.items() if k != "vocab_size"},
            "summary": summary,
            "target": {
                "ratio": TARGET_RATIO,
                "pass": ok,
                "detail": target_line,
            },
        },
    )
    report.write_markdown(
        out_dir / "vllm_e2e.md",
        markdown_lines(info, settings, result, summary, quick, elapsed),
    )
    write_plot(out_dir / "vllm_e2e.png", result, summary)
    return ok and not problems
