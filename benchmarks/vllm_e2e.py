"""End to end: CPU vLLM decode tokens/s without LoRA, with vLLM's, with ours.

Run with ``python -m benchmarks.vllm_e2e`` in the environment that
has the CPU build of vLLM and this package (``--quick`` for a smoke test,
``--out DIR``, ``--rounds N``; see ``--help``).

The model is a random-weight Llama with Llama-2-7B layer shapes (hidden 4096,
MLP 11008, 32 heads, 32 KV heads) but only a few layers, and the small
byte-level BPE vocabulary of `vllm_cpu_lora.tiny_model` (so the LM head costs
almost nothing, as in a 32-layer model where it is a few percent). It is
saved in bfloat16 with four random PEFT LoRA adapters (rank 16 on q, k, v,
o, gate, up and down, non-zero A and B) in a cache folder, so reruns skip
building them.

Three configurations, each served by its own long-lived vLLM child process
(the plug-in decides per process, and vLLM spawns processes of its own):

* ``no-lora``: ``enable_lora=False``;
* ``vllm-torch``: ``enable_lora=True`` (4 slots, rank 16), requests spread
  round robin over the 4 adapters, ``VLLM_CPU_LORA_DISABLE=1``: vLLM's own
  `PunicaWrapperCPU` and its pure-torch ops;
* ``ours``: the same with the plug-in active: `PunicaWrapperCPULoRA`.

Each child is checked for the wrapper it really used. The workload is one
batched offline ``LLM.generate`` of fixed-length greedy requests
(``ignore_eos``); decode tokens/s is ``B * (N - 1) / (t_N - t_1)``, from a
run with ``max_tokens=N`` and one with ``max_tokens=1`` right after each
other, so prefill, the first token and per-call overheads cancel. After a
warm-up the configurations take turns, round by round in rotating order, and
each figure is a median over rounds (the machine is shared and noisy).
Optionally (the default of a full run) one more long run of each LoRA
configuration is profiled with torch.profiler inside vLLM's worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import common
from benchmarks.vllm_child import Child
from benchmarks.vllm_report import (
    CONFIGS,
    LORA_RANK,
    NUM_ADAPTERS,
    OUR_WRAPPER,
    Config,
)

# Bump when the model or adapters built below change.
_MODEL_VERSION = 1
_LLAMA7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Workload size."""

    num_layers: int
    batch: int
    max_tokens: int
    rounds: int
    warmup_tokens: int
    profile: bool
    assign: str


def settings_for(args: argparse.Namespace) -> Settings:
    """The workload the command line asks for (defaults: quick or full)."""
    quick = args.quick
    return Settings(
        num_layers=args.layers or (1 if quick else 4),
        batch=args.batch or (16 if quick else 32),
        max_tokens=args.max_tokens or (32 if quick else 64),
        rounds=args.rounds or (1 if quick else 5),
        warmup_tokens=8 if quick else 16,
        profile=(not quick) if args.profile is None else args.profile,
        assign=args.assign,
    )


def prompts(batch: int) -> list[str]:
    """`batch` distinct short prompts from the demo's sentences."""
    from vllm_cpu_lora.tiny_model import PROMPTS

    return [f"{i}. {PROMPTS[i % len(PROMPTS)]}" for i in range(batch)]


# ------------------------------------------------------------------ models


def _cache_root() -> pathlib.Path:
    """Where the benchmark's models are kept between runs."""
    root = pathlib.Path(
        os.environ.get("VLLM_CPU_LORA_CACHE")
        or pathlib.Path.home() / ".cache" / "vllm-cpu-lora"
    )
    return root / "bench-models"


def build_llama(path: pathlib.Path, num_layers: int, seed: int = 0) -> None:
    """Saves a random bf16 Llama with Llama-2-7B layer shapes to `path`.

    The tokenizer is the demo's (trained offline on a few sentences); the
    weights are transformers' own random initialisation (std 0.02).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_cpu_lora.tiny_model import build_tiny_llama

    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vcl_tok_") as tmp:
        tiny = build_tiny_llama(pathlib.Path(tmp) / "tiny", num_layers=1)
        for f in tiny.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, path / f.name)
        tiny_config = json.loads((tiny / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=tiny_config["vocab_size"],
        num_hidden_layers=num_layers,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        bos_token_id=tiny_config["bos_token_id"],
        eos_token_id=tiny_config["eos_token_id"],
        tie_word_embeddings=False,
        **_LLAMA7B,
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.02)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path)


def ensure_models(num_layers: int) -> dict[str, Any]:
    """The cached model and adapters for `num_layers`, built if missing.

    Returns:
        ``{"base": path, "adapters": {name: path}, "built_s": seconds}``.
    """
    from vllm_cpu_lora.tiny_model import build_lora_adapter

    root = _cache_root() / f"llama7b-shapes-{num_layers}l-v{_MODEL_VERSION}"
    base = root / "base"
    names = [f"adapter-{i + 1}" for i in range(NUM_ADAPTERS)]
    done = root / "COMPLETE"
    started = time.perf_counter()
    if not done.exists():
        print(f"Building the model and adapters in {root} ...", flush=True)
        if root.exists():
            shutil.rmtree(root)
        build_llama(base, num_layers)
        for i, name in enumerate(names):
            build_lora_adapter(
                base, root / name, seed=i + 1, rank=LORA_RANK, b_std=0.02
            )
        done.write_text("ok\n")
    else:
        print(f"Using the cached model and adapters in {root}", flush=True)
    return {
        "base": str(base),
        "adapters": {name: str(root / name) for name in names},
        "built_s": time.perf_counter() - started,
    }


def _check_routing(
    config: Config, report: dict[str, Any], log: str
) -> list[str]:
    """Problems with the LoRA wrapper a child used (empty: as expected)."""
    problems = []
    wrappers = report.get("wrappers", [])
    calls = report.get("calls", {})
    if config.wrapper is None:
        if wrappers or calls:
            problems.append(f"LoRA wrappers {wrappers}, calls {calls}")
    elif wrappers != [config.wrapper]:
        problems.append(f"wrapper {wrappers}, expected {config.wrapper}")
    if config.wrapper == OUR_WRAPPER:
        if not calls:
            problems.append("no vllm_cpu_lora op calls counted")
        if "vllm_cpu_lora: LoRA on CPU uses" not in log:
            problems.append("the plug-in did not log that it is active")
    elif calls:
        problems.append(f"vllm_cpu_lora ops were called: {calls}")
    if config.disable_plugin and "VLLM_CPU_LORA_DISABLE is set" not in log:
        problems.append("the plug-in did not log that it is disabled")
    return problems


def _log_facts(log: str) -> list[str]:
    """vLLM's log lines about threads, KV cache and the LoRA wrapper."""
    keys = (
        "OMP threads binding",
        "omp_cpuids",
        "for KV cache",
        "Using PunicaWrapper",
        "vllm_cpu_lora: LoRA on CPU uses",
        "VLLM_CPU_LORA_DISABLE is set",
    )
    facts = []
    for line in log.splitlines():
        for key in keys:
            if key in line and not any(key in f for f in facts):
                facts.append(line.strip()[-300:])
    return facts


def _decode_rate(
    batch: int, max_tokens: int, short: dict[str, Any], long: dict[str, Any]
) -> tuple[float, float]:
    """Decode tokens/s and seconds from a 1-token and an N-token run."""
    decode_s = long["elapsed_s"] - short["elapsed_s"]
    tokens = batch * (max_tokens - 1)
    return tokens / decode_s if decode_s > 0 else float("nan"), decode_s


def run(settings: Settings, models: dict[str, Any]) -> dict[str, Any]:
    """Starts the children, warms up, measures; returns the raw results."""
    texts = prompts(settings.batch)
    spec = {
        "model": models["base"],
        "adapters": models["adapters"],
        "max_lora_rank": LORA_RANK,
        "max_model_len": 512,
        "prompts": texts,
        "assign": settings.assign,
    }
    n = settings.max_tokens
    result: dict[str, Any] = {
        "configs": {},
        "rounds": [],
        "routing_problems": {},
    }
    with tempfile.TemporaryDirectory(prefix="vcl_vllm_e2e_") as tmp:
        children: list[Child] = []
        try:
            for config in CONFIGS:
                print(f"Starting vLLM for {config.name} ...", flush=True)
                child = Child(config, spec, pathlib.Path(tmp))
                children.append(child)
                ready = child.wait(0, timeout=900)
                child.call("generate", max_tokens=1)
                warm = child.call("generate", max_tokens=settings.warmup_tokens)
                report = child.call("report")
                log = child.log_text()
                problems = _check_routing(config, report, log)
                result["routing_problems"][config.name] = problems
                result["configs"][config.name] = {
                    "title": config.title,
                    "enable_lora": config.enable_lora,
                    "plugin_disabled": config.disable_plugin,
                    "engine_start_s": ready["engine_start_s"],
                    "wrappers": report.get("wrappers", []),
                    "worker_threads": report["threads"],
                    "op_calls_after_warmup": report.get("calls", {}),
                    "prompt_tokens": warm["prompt_tokens"],
                    "log_facts": _log_facts(log),
                }
                print(
                    f"  engine start {ready['engine_start_s']:.0f} s; "
                    f"wrapper {report.get('wrappers') or 'none'}; "
                    f"routing {'OK' if not problems else problems}",
                    flush=True,
                )
            for r in range(settings.rounds):
                k = r % len(children)
                order = children[k:] + children[:k]
                row = {}
                for child in order:
                    short = child.call("generate", max_tokens=1)
                    long = child.call("generate", max_tokens=n)
                    bad = [c for c in long["output_tokens"] if c != n]
                    if bad:
                        raise RuntimeError(
                            f"{child.config.name}: {len(bad)} requests "
                            f"stopped early ({bad[:4]} tokens, not {n})"
                        )
                    rate, decode_s = _decode_rate(
                        settings.batch, n, short, long
                    )
                    row[child.config.name] = {
                        "t1_s": short["elapsed_s"],
                        "tN_s": long["elapsed_s"],
                        "decode_s": decode_s,
                        "decode_tok_s": rate,
                    }
                    print(
                        f"  round {r + 1}/{settings.rounds} "
                        f"{child.config.name:>10}: prefill+1 "
                        f"{short['elapsed_s']:6.2f} s, {n} tokens "
                        f"{long['elapsed_s']:6.2f} s -> decode "
                        f"{rate:7.1f} tok/s",
                        flush=True,
                    )
                result["rounds"].append(row)
            if settings.profile:
                result["profiles"] = {}
                for child in children:
                    print(
                        f"Profiling {child.config.name} ({n} tokens) ...",
                        flush=True,
                    )
                    prof = child.call("profile", max_tokens=n, top=30)
                    result["profiles"][child.config.name] = prof["profile"]
            for child in children:
                report = child.call("report")
                result["configs"][child.config.name]["op_calls_total"] = (
                    report.get("calls", {})
                )
        finally:
            for child in children:
                child.close()
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see --help)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_e2e",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 layer, 16 prompts x 32 tokens, 1 round (smoke test)",
    )
    common.out_argument(parser)
    parser.add_argument("--layers", type=int, help="decoder layers (4)")
    parser.add_argument("--batch", type=int, help="prompts per batch (32)")
    parser.add_argument(
        "--max-tokens", type=int, help="output tokens per request (64)"
    )
    parser.add_argument("--rounds", type=int, help="measured rounds (5)")
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="profile one more run of each LoRA config (default: on, off "
        "with --quick)",
    )
    parser.add_argument(
        "--assign",
        choices=("round-robin", "grouped"),
        default="round-robin",
        help="adapters of the requests in batch order: round robin (every "
        "token's neighbour has another adapter; the default) or grouped "
        "(one run of requests per adapter)",
    )
    args = parser.parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the end-to-end benchmark; 1 if the target or a check failed."""
    args = parse_args(argv)

    import torch
    import vllm

    from benchmarks import machine, vllm_report

    out_dir = common.out_dir(args)
    started = time.perf_counter()
    settings = settings_for(args)
    info = machine.describe_machine(torch.get_num_threads())
    print(f"CPU: {info['cpu']}; vLLM {vllm.__version__}", flush=True)
    print(
        f"Workload: {settings.num_layers} Llama-7B-shaped layer(s), "
        f"{settings.batch} prompts x {settings.max_tokens} tokens, "
        f"{settings.rounds} round(s)",
        flush=True,
    )
    models = ensure_models(settings.num_layers)
    result = run(settings, models)
    info["load_average_end"] = machine.load_average()
    base_config = json.loads(
        (pathlib.Path(models["base"]) / "config.json").read_text()
    )
    result.update(
        {
            "vllm": vllm.__version__,
            "vocab_size": base_config["vocab_size"],
            "prompt_tokens": result["configs"]["no-lora"]["prompt_tokens"],
            "kv_cache_space": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "settings": dataclasses.asdict(settings),
        }
    )
    model = {
        "base": models["base"],
        "config": {
            k: base_config[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "num_hidden_layers",
                "vocab_size",
            )
        },
        "adapters": NUM_ADAPTERS,
        "lora_rank": LORA_RANK,
    }
    elapsed = time.perf_counter() - started
    ok = vllm_report.finish(
        info, settings, result, model, args.quick, elapsed, out_dir
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
