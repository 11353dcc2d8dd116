"""The end-to-end benchmark's outputs: <name>.md, .json and .png.

The markdown report of one run (`markdown_lines`), and `finish`, which
prints a run's summary and writes its files.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import TYPE_CHECKING, Any

from benchmarks import report, vllm_models
from benchmarks.vllm_report import (
    CONFIGS,
    PR_TOKENS_PER_S,
    TARGET_RATIO,
    Config,
    ratios_table,
    results_table,
    run_configs,
    summarize,
    target,
    write_plot,
)
from benchmarks.vllm_runner import SETTLE_S

if TYPE_CHECKING:
    from benchmarks.vllm_e2e import Settings


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


def _model_line(settings: Settings, result: dict[str, Any]) -> str:
    """Markdown bullet: the model."""
    shape = settings.shape
    vocab = result["vocab_size"]
    line = (
        f"- `--model {settings.model}`: random-weight Llama, bf16, hidden "
        f"{shape.hidden_size}, MLP {shape.intermediate_size}, "
        f"{shape.num_heads} heads, {shape.num_kv_heads} KV heads, "
        f"{shape.num_layers} layer(s), vocabulary {vocab}"
    )
    if shape.vocab_size is None:
        return line + (
            " (the demo's byte-level BPE tokenizer: the LM head is "
            "negligible, as in a 32-layer model where it is a few percent)."
        )
    return line + (
        f" ({'tied' if shape.tie_word_embeddings else 'untied'} "
        "embeddings; the tokenizer is the demo's small one, so prompts are "
        "ids below 512: only the model's vocabulary sets the LM head's "
        "cost, and outputs are not detokenized)."
    )


def _method_lines(settings: Settings, configs: list[Config]) -> list[str]:
    """Markdown bullets: how the configurations were run and timed."""
    lines = [
        "- Each configuration runs in its own vLLM child process "
        "(`enable_lora=False`; `VLLM_CPU_LORA_DISABLE=1` for vLLM's own "
        "`PunicaWrapperCPU`; the plug-in active for ours). Each child "
        "reports the Punica wrapper its worker built, our op counters, its "
        "compilation mode and the graphs torch.compile captured.",
    ]
    if any(c.skip_kernels for c in configs):
        lines.append(
            "- 'kernels skipped' is a diagnostic: ours with every kernel "
            "call replaced by a no-op in the worker (its outputs are the "
            "base model's), so its gap to no-LoRA is what vLLM's LoRA "
            "layers cost (slicing, buffers, metadata, Python) whatever the "
            "kernels."
        )
    lines += [
        "- Per round and configuration: t_1, a generate with "
        "`max_tokens=1`, then t_N, one with `max_tokens=N`. Decode "
        "tokens/s = B x (N - 1) / (t_N - t_1), so prefill, the first token "
        "and per-call overhead cancel. Prefill tokens/s = the batch's "
        "prompt tokens / t_1 (the prefill step with its first sampled "
        "token and one call's overhead). Generate tokens/s = B x N / t_N "
        "(plain throughput, the form of most quoted figures).",
    ]
    if settings.fresh_children:
        lines.append(
            "- The configurations do not fit in memory together, so they "
            "run one after another: in every round each configuration gets "
            "a fresh child (engine start, compilation where it applies, "
            f"warm-up of 1 and {settings.warmup_tokens} tokens, then t_1 "
            f"and t_N), the order rotating over rounds; {settings.rounds} "
            "round(s). Figures are medians over rounds."
        )
    else:
        lines.append(
            "- All children live through the whole run. Warm-up in each "
            f"(1 and {settings.warmup_tokens} tokens), then "
            f"{settings.rounds} round(s), the configurations taking turns "
            f"in rotating order, each {SETTLE_S:g} s after the one before "
            "(vLLM's idle workers poll their queue for a second after their "
            "last step, on the same cores); figures are medians over rounds."
        )
    lines.append(
        "- 'per-round decode ratios' is the range of each round's ratio to "
        "that round's no-LoRA figure (a measure of the noise)."
    )
    return lines


def markdown_lines(
    m: dict[str, Any],
    settings: Settings,
    result: dict[str, Any],
    summary: dict[str, Any],
    command: str,
    elapsed: float,
) -> list[str]:
    """The run's markdown report."""
    _, target_line = target(summary)
    configs = run_configs(result)
    problems = {k: v for k, v in result["routing_problems"].items() if v}
    eager = settings.enforce_eager
    threads = result["configs"]["ours"]["worker_threads"]
    loads = [row["load_1min"] for row in result["rounds"]]
    lines = [
        "# CPU vLLM end to end: tokens/s with and without LoRA"
        + (" (eager)" if eager else " at vLLM's defaults"),
        "",
        f"Generated by `{command}` on {m['date']} in {elapsed:.0f} s "
        f"(vLLM {result['vllm']}).",
        "",
        "## Machine",
        "",
        *report.cpu_lines(m, threads=False, caches=False),
        f"- vLLM's worker runs {threads['torch_threads']} torch thread(s) "
        f"on CPU(s) {threads['affinity']} (`VLLM_CPU_OMP_THREADS_BIND="
        f"{settings.omp_bind or 'auto'}`).",
        f"- 1-minute load average {m['load_average_start']:.1f} at the "
        f"start, {m['load_average_end']:.1f} at the end, "
        + ", ".join(f"{x:.1f}" for x in loads)
        + " at the start of each round (this benchmark's own processes "
        "included; a shared machine: other work on the cores makes the "
        "figures noisy, so the ratios side by side are the result).",
        "",
        "## Model and workload",
        "",
        _model_line(settings, result),
        f"- {settings.adapters} random PEFT LoRA adapter(s), rank "
        f"{settings.rank} on "
        f"{vllm_models.describe_targets(settings.targets)} (non-zero A and "
        "B); "
        + (
            "requests assigned round robin."
            if settings.assign == "round-robin"
            else "requests grouped by adapter."
        ),
        f"- One batched offline `LLM.generate` of {settings.batch} prompts "
        f"({min(result['prompt_tokens'])}..{max(result['prompt_tokens'])} "
        f"tokens), greedy, `ignore_eos`, {settings.max_tokens} output "
        "tokens each.",
        "- vLLM: `dtype=bfloat16`, "
        + (
            "`enforce_eager=True`"
            if eager
            else "no `enforce_eager` (its default compilation; vLLM itself "
            "forces eager mode when LoRA is enabled, the plug-in does not)"
        )
        + f", prefix caching off, `max_model_len={settings.max_len}`, "
        f"`max_num_batched_tokens={settings.batched_tokens}` (vLLM's CPU "
        "default budget of 4096 tokens only makes its warm-up's dummy batch "
        "longer: every prefill here fits in one step), "
        f"`VLLM_CPU_KVCACHE_SPACE={result['kv_cache_space']}` GiB; LoRA "
        f"configs: `enable_lora=True`, `max_loras={settings.adapters}`, "
        f"`max_lora_rank={settings.rank}`.",
        "",
        "## Method",
        "",
        *_method_lines(settings, configs),
        "",
        "## Routing and compilation check",
        "",
    ]
    for config in configs:
        c = result["configs"][config.name]
        calls = c.get("op_calls_total") or c["op_calls_after_warmup"]
        status = (
            "OK"
            if not result["routing_problems"][config.name]
            else (
                "PROBLEM: " + "; ".join(result["routing_problems"][config.name])
            )
        )
        starts = ", ".join(f"{t:.0f}" for t in c["engine_start_s"])
        lines.append(
            f"- {config.title}: wrapper "
            f"{', '.join(f'`{w}`' for w in c['wrappers']) or 'none'}; "
            f"compilation mode `{c['compilation_mode']}`, "
            f"{c['dynamo_graphs']} dynamo graph(s); engine start {starts} "
            "s; vllm_cpu_lora op calls: "
            + (
                ", ".join(f"{k} {v}" for k, v in sorted(calls.items()))
                or "none"
            )
            + f" ({status})"
        )
    lines += [
        "",
        "From the log of one child (ours):",
        "",
        "```",
        *result["configs"]["ours"]["log_facts"],
        "```",
        "",
        "## Results",
        "",
        *ratios_table(summary),
        "",
        *results_table(result, summary, settings.batch, markdown=True),
        "",
    ]
    if settings.model == "llama-2-7b":
        theirs = summary["vllm-torch"]["generate_tok_s_median"]
        lines += [
            f"vLLM's CPU-LoRA pull request reported {PR_TOKENS_PER_S} "
            f"tokens/s for stock CPU vLLM here ({settings.batch} prompts x "
            f"{settings.max_tokens} tokens, one rank-{settings.rank} "
            f"adapter); on this machine vLLM's own path makes "
            f"{theirs:.2f} generate tokens/s (B x N / t_N, median), ours "
            f"{summary['ours']['generate_tok_s_median']:.2f}, no LoRA "
            f"{summary['no-lora']['generate_tok_s_median']:.2f}.",
            "",
        ]
    names = [c.name for c in configs]
    lines += [
        "Per round (decode tokens/s; prefill tokens/s in brackets):",
        "",
        "| round | load | " + " | ".join(names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    for i, row in enumerate(result["rounds"]):
        lines.append(
            f"| {i + 1} | {row['load_1min']:.1f} | "
            + " | ".join(
                f"{row[n]['decode_tok_s']:.2f} ({row[n]['prefill_tok_s']:.1f})"
                for n in names
            )
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
            f"One more {settings.max_tokens}-token generate per "
            "configuration under torch.profiler (CPU ops in vLLM's worker "
            "process, prefill included; the profiler adds overhead of its "
            "own). A single run each, so noisy too, but op by op. Top ops "
            "by self time:",
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


def finish(
    info: dict[str, Any],
    settings: Settings,
    result: dict[str, Any],
    model: dict[str, Any],
    command: str,
    elapsed: float,
    out_dir: pathlib.Path,
    name: str,
) -> bool:
    """Prints the summary; writes <name>.json, .md and .png.

    Returns:
        Whether the target is met and every child used the wrapper and
        compilation mode meant.
    """
    summary = summarize(result)
    ok, target_line = target(summary)
    problems = {k: v for k, v in result["routing_problems"].items() if v}

    print()
    print("\n".join(ratios_table(summary)))
    print()
    print("\n".join(results_table(result, summary, settings.batch, False)))
    print()
    print(target_line)
    for config, p in problems.items():
        print(f"FAIL  routing of {config}: {'; '.join(p)}")
    for config, prof in result.get("profiles", {}).items():
        print(f"\nTop ops by self time, {config}:")
        for op in prof["ops"][:10]:
            print(
                f"  {100 * op['share']:5.1f}%  {op['self_us'] / 1000:9.1f} ms"
                f"  {op['calls']:7d}  {op['name']}"
            )
    print(f"\nDone in {elapsed:.0f} s; results in {out_dir}/{name}.md")

    report.write_json(
        out_dir / f"{name}.json",
        {
            "machine": info,
            "command": command,
            "elapsed_s": elapsed,
            "model": model,
            **result,
            "summary": summary,
            "target": {
                "ratio": TARGET_RATIO,
                "pass": ok,
                "detail": target_line,
            },
        },
    )
    report.write_markdown(
        out_dir / f"{name}.md",
        markdown_lines(info, settings, result, summary, command, elapsed),
    )
    if importlib.util.find_spec("matplotlib"):
        write_plot(out_dir / f"{name}.png", settings, result, summary)
    else:  # vLLM's environment need not have it
        print("No matplotlib: no plot")
    return ok and not problems
