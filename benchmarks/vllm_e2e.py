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
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from typing import Any

_MODULE = "benchmarks.vllm_e2e"
TARGET_RATIO = 0.95
VLLM_WRAPPER = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"
OUR_WRAPPER = "vllm_cpu_lora.punica.PunicaWrapperCPULoRA"
NUM_ADAPTERS = 4
LORA_RANK = 16
# Bump when the model or adapters built below change.
_MODEL_VERSION = 1
_LLAMA7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}


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
    # kernels' work (worker_skip_kernels), so that its gap to no-LoRA is what
    # vLLM's LoRA layers cost around any kernels.
    Config(
        "no-kernels",
        "4 adapters, vllm_cpu_lora, kernels skipped",
        True,
        False,
        OUR_WRAPPER,
        skip_kernels=True,
    ),
)


class _NoKernels:
    """vllm_cpu_lora.ops with every op doing nothing (see CONFIGS)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def worker_skip_kernels(worker: Any = None) -> None:
    """In a vLLM worker: our Punica wrapper calls no-op kernels from now on
    (for `LLM.collective_rpc`). Its outputs are then those of the base
    model, which is all a timing of LoRA's overhead needs."""
    from vllm_cpu_lora import punica

    punica.ops = _NoKernels()


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


# ------------------------------------------------------------ child side


def worker_profile_start(worker: Any) -> None:
    """Starts torch.profiler in a vLLM worker (for `collective_rpc`).

    vLLM pickles these functions by value, so module globals do not last
    from one call to the next: the profiler lives on the worker.
    """
    import torch

    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    )
    worker.vllm_cpu_lora_profiler = prof
    prof.start()


def worker_profile_stop(worker: Any, top: int = 20) -> dict[str, Any]:
    """Stops the worker's profiler; returns the top ops by self CPU time."""
    prof = worker.vllm_cpu_lora_profiler
    del worker.vllm_cpu_lora_profiler
    prof.stop()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    ours = sum(
        e.self_cpu_time_total
        for e in events
        if e.key.startswith("vllm_cpu_lora::")
    )
    return {
        "total_self_us": total,
        "vllm_cpu_lora_share": ours / total if total else 0.0,
        "ops": [
            {
                "name": e.key,
                "calls": e.count,
                "self_us": e.self_cpu_time_total,
                "share": e.self_cpu_time_total / total if total else 0.0,
            }
            for e in events[:top]
        ],
    }


def worker_threads(worker: Any = None) -> dict[str, Any]:
    """A vLLM worker's torch threads and CPU affinity (for `collective_rpc`)."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
    }


def _child_main(spec_file: str) -> int:
    """A vLLM child: builds the engine, then serves commands from stdin.

    Each command is a JSON line with ``seq`` and ``op`` (``generate`` with
    ``max_tokens``, ``report``, ``profile`` with ``max_tokens``, ``exit``);
    the reply goes to ``<replies>/<seq>.json`` (seq 0: engine ready).
    """
    spec = json.loads(pathlib.Path(spec_file).read_text())
    replies = pathlib.Path(spec["replies"])

    def reply(seq: int, obj: dict[str, Any]) -> None:
        tmp = replies / f"{seq}.tmp"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, replies / f"{seq}.json")

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_cpu_lora.punica import worker_lora_report

    started = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if spec["enable_lora"]:
        kwargs = {
            "enable_lora": True,
            "max_loras": len(spec["adapters"]),
            "max_lora_rank": spec["max_lora_rank"],
        }
    try:
        llm = LLM(
            model=spec["model"],
            dtype="bfloat16",
            max_model_len=spec["max_model_len"],
            enforce_eager=True,
            enable_prefix_caching=False,
            seed=0,
            **kwargs,
        )
    except Exception as e:  # reported to the parent
        reply(0, {"error": f"{type(e).__name__}: {e}"})
        return 1
    if spec.get("skip_kernels"):
        llm.collective_rpc(worker_skip_kernels)
    reply(0, {"engine_start_s": time.perf_counter() - started})

    texts = spec["prompts"]
    loras = None
    if spec["enable_lora"]:
        requests = [
            LoRARequest(name, i + 1, path)
            for i, (name, path) in enumerate(spec["adapters"].items())
        ]
        k = len(requests)
        if spec["assign"] == "grouped":
            loras = [requests[i * k // len(texts)] for i in range(len(texts))]
        else:
            loras = [requests[i % k] for i in range(len(texts))]

    def generate(max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        )
        t = time.perf_counter()
        outs = llm.generate(texts, params, lora_request=loras, use_tqdm=False)
        elapsed = time.perf_counter() - t
        counts = [len(o.outputs[0].token_ids) for o in outs]
        return {
            "elapsed_s": elapsed,
            "output_tokens": counts,
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
        }

    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "generate":
                out = generate(cmd["max_tokens"])
            elif cmd["op"] == "report":
                out = llm.collective_rpc(worker_lora_report)[0]
                out["threads"] = llm.collective_rpc(worker_threads)[0]
            elif cmd["op"] == "profile":
                llm.collective_rpc(worker_profile_start)
                out = generate(cmd["max_tokens"])
                out["profile"] = llm.collective_rpc(
                    worker_profile_stop, kwargs={"top": cmd.get("top", 20)}
                )[0]
            elif cmd["op"] == "exit":
                reply(cmd["seq"], {})
                break
            else:
                out = {"error": f"unknown op {cmd['op']!r}"}
        except Exception as e:  # reported to the parent
            out = {"error": f"{type(e).__name__}: {e}"}
        reply(cmd["seq"], out)
    return 0


# ----------------------------------------------------------- parent side


class Child:
    """A long-lived vLLM child process serving one configuration."""

    def __init__(
        self,
        config: Config,
        spec: dict[str, Any],
        workdir: pathlib.Path,
    ) -> None:
        from vllm_cpu_lora.offline import child_env

        self.config = config
        self.replies = workdir / f"{config.name}-replies"
        self.replies.mkdir()
        self.log_path = workdir / f"{config.name}.log"
        spec_file = workdir / f"{config.name}-spec.json"
        spec_file.write_text(
            json.dumps(
                {
                    **spec,
                    "enable_lora": config.enable_lora,
                    "skip_kernels": config.skip_kernels,
                    "replies": str(self.replies),
                }
            )
        )
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", _MODULE, "--child", str(spec_file)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env(config.disable_plugin),
            text=True,
            start_new_session=True,
        )
        self.seq = 0

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, seq: int, timeout: float) -> dict[str, Any]:
        """Waits for reply `seq`; raises on error, death or timeout."""
        path = self.replies / f"{seq}.json"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.config.name}: vLLM child exited with "
                    f"{self.proc.returncode}; log {self.log_path} ends "
                    f"with:\n{self.log_text()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.config.name}: no reply in {timeout:.0f} s; log "
                    f"{self.log_path} ends with:\n{self.log_text()[-4000:]}"
                )
            time.sleep(0.02)
        out = json.loads(path.read_text())
        if out.get("error"):
            raise RuntimeError(
                f"{self.config.name}: {out['error']}; log {self.log_path} "
                f"ends with:\n{self.log_text()[-4000:]}"
            )
        return out

    def call(self, op: str, timeout: float = 900, **kw: Any) -> dict[str, Any]:
        self.seq += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"seq": self.seq, "op": op, **kw}))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.wait(self.seq, timeout)

    def close(self) -> None:
        """Asks the child to exit; ends its process group if it does not."""
        try:
            if self.proc.poll() is None:
                self.call("exit", timeout=60)
                self.proc.wait(timeout=60)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            # Our own child's session: the front end and vLLM's engine.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def _check_routing(config: Config, report: dict, log: str) -> list[str]:
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


def _decode_rate(batch: int, max_tokens: int, short: dict, long: dict):
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


# ------------------------------------------------------------ summarising


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
    if markdown:
        return [
            "| " + " | ".join(head) + " |",
            "|---|" + "---:|" * (len(head) - 1),
            *("| " + " | ".join(r) + " |" for r in rows),
        ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = "  ".join(
        f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths)
    )
    return [fmt.format(*head)] + [fmt.format(*r) for r in rows]


def target(summary: dict[str, Any]) -> tuple[bool, str]:
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


def write_markdown(
    path: pathlib.Path,
    machine: dict[str, Any],
    settings: Settings,
    result: dict[str, Any],
    summary: dict[str, Any],
    quick: bool,
    elapsed: float,
) -> None:
    m = machine
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
        f"- CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs)",
        f"- Flags: {' '.join(m['flags'])}",
        f"- torch {m['torch']}, Python {m['python']}; vllm_cpu_lora ISA "
        f"path `{m['isa_path']}`",
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
    path.write_text("\n".join(lines))


def write_plot(
    path: pathlib.Path, result: dict[str, Any], summary: dict[str, Any]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_e2e",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 layer, 16 prompts x 32 tokens, 1 round (smoke test)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="output folder (default benchmarks/results, with --quick "
        "benchmarks/results/quick)",
    )
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
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return _child_main(args.child)

    import torch
    import vllm

    from benchmarks import common
    from benchmarks.kernels import describe_machine

    out_dir = args.out or common.default_out_dir(args.quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    settings = settings_for(args)
    machine = describe_machine(torch.get_num_threads())
    print(f"CPU: {machine['cpu']}; vLLM {vllm.__version__}", flush=True)
    print(
        f"Workload: {settings.num_layers} Llama-7B-shaped layer(s), "
        f"{settings.batch} prompts x {settings.max_tokens} tokens, "
        f"{settings.rounds} round(s)",
        flush=True,
    )
    models = ensure_models(settings.num_layers)
    result = run(settings, models)
    machine["load_average_end"] = common.load_average()
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
    summary = summarize(result)
    elapsed = time.perf_counter() - started
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

    (out_dir / "vllm_e2e.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "quick": args.quick,
                "elapsed_s": elapsed,
                "model": {
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
                },
                **{k: v for k, v in result.items() if k != "vocab_size"},
                "summary": summary,
                "target": {
                    "ratio": TARGET_RATIO,
                    "pass": ok,
                    "detail": target_line,
                },
            },
            indent=1,
            allow_nan=True,
        )
    )
    write_markdown(
        out_dir / "vllm_e2e.md",
        machine,
        settings,
        result,
        summary,
        args.quick,
        elapsed,
    )
    write_plot(out_dir / "vllm_e2e.png", result, summary)
    return 0 if ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
