"""The end-to-end benchmark's runs: children started, checked and timed.

`run` starts a vLLM child (`benchmarks.vllm_child`) per configuration,
checks that each used the LoRA wrapper and compilation mode meant, and
times rounds of t_1 / t_N generates (see `benchmarks.vllm_e2e`).
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from typing import TYPE_CHECKING, Any

from benchmarks.vllm_child import Child
from benchmarks.vllm_report import CONFIGS, OUR_WRAPPER, Config

# Children living together share the cores, and vLLM's idle workers poll
# their message queue for a second after their last step (the busy loop of
# vllm/distributed/device_communicators/shm_broadcast.py): a 1-token generate
# started right after another child's run took up to twice as long. Each
# measurement waits this long first (docs/vllm.md#children-taking-turns).
SETTLE_S = 2.0

if TYPE_CHECKING:
    from benchmarks.vllm_e2e import Settings


def prompts(batch: int) -> list[str]:
    """`batch` distinct short prompts from the demo's sentences."""
    from vllm_cpu_lora.tiny_model import PROMPTS

    return [f"{i}. {PROMPTS[i % len(PROMPTS)]}" for i in range(batch)]


def expected_mode(config: Config, enforce_eager: bool) -> str:
    """The compilation mode a configuration's worker must report.

    vLLM compiles by default but forces eager mode for LoRA; the plug-in
    lifts that for its own wrapper.
    """
    if enforce_eager or (config.enable_lora and config.disable_plugin):
        return "NONE"
    return "DYNAMO_TRACE_ONCE"


def _check_routing(
    config: Config, report: dict[str, Any], log: str, enforce_eager: bool
) -> list[str]:
    """Problems with the LoRA wrapper and compilation mode a child used
    (empty: as expected)."""
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
    mode = expected_mode(config, enforce_eager)
    if report.get("compilation_mode") != mode:
        problems.append(
            f"compilation mode {report.get('compilation_mode')}, "
            f"expected {mode}"
        )
    graphs = report.get("dynamo_graphs", 0)
    if (mode == "NONE") != (graphs == 0):
        problems.append(f"{graphs} dynamo graph(s) in mode {mode}")
    return problems


def _log_facts(log: str) -> list[str]:
    """vLLM's log lines about threads, KV cache, compilation and LoRA."""
    keys = (
        "OpenMP thread binding",
        "local_rank=0, core ids",
        "omp_cpuids",
        "for KV cache",
        "Using PunicaWrapper",
        "vllm_cpu_lora: LoRA on CPU uses",
        "VLLM_CPU_LORA_DISABLE is set",
        "vllm_cpu_lora: LoRA with compilation mode",
        "torch.compile takes",
    )
    facts = []
    for line in log.splitlines():
        for key in keys:
            if key in line and not any(key in f for f in facts):
                facts.append(line.strip()[-300:])
    return facts


def _rates(
    batch: int,
    max_tokens: int,
    short: dict[str, Any],
    long: dict[str, Any],
) -> dict[str, float]:
    """A round's figures from a 1-token and an N-token run."""
    decode_s = long["elapsed_s"] - short["elapsed_s"]
    tokens = batch * (max_tokens - 1)
    return {
        "t1_s": short["elapsed_s"],
        "tN_s": long["elapsed_s"],
        "decode_s": decode_s,
        "decode_tok_s": tokens / decode_s if decode_s > 0 else float("nan"),
        "prefill_tok_s": sum(short["prompt_tokens"]) / short["elapsed_s"],
        "generate_tok_s": batch * max_tokens / long["elapsed_s"],
    }


class Runner:
    """Starts, checks and times the children of one run."""

    def __init__(
        self, settings: Settings, spec: dict[str, Any], workdir: pathlib.Path
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.workdir = workdir
        self.starts = 0
        self.result: dict[str, Any] = {
            "configs": {},
            "rounds": [],
            "routing_problems": {},
        }

    def start(self, config: Config) -> Child:
        """A warmed-up, checked child for `config`; records what it used."""
        from benchmarks import machine

        self.starts += 1
        workdir = self.workdir / f"start-{self.starts}"
        workdir.mkdir()
        print(
            f"Starting vLLM for {config.name} (load "
            f"{machine.load_average():.1f}) ...",
            flush=True,
        )
        env = {"VLLM_CPU_OMP_THREADS_BIND": self.settings.omp_bind}
        child = Child(config, self.spec, workdir, extra_env=env)
        try:
            ready = child.wait(0, timeout=1800)
            child.call("generate", max_tokens=1)
            warm = child.call(
                "generate", max_tokens=self.settings.warmup_tokens
            )
            report = child.call("report")
        except BaseException:
            child.close()
            raise
        log = child.log_text()
        problems = _check_routing(
            config, report, log, self.settings.enforce_eager
        )
        known = self.result["routing_problems"].setdefault(config.name, [])
        known += [p for p in problems if p not in known]
        entry = self.result["configs"].setdefault(
            config.name,
            {
                "title": config.title,
                "enable_lora": config.enable_lora,
                "plugin_disabled": config.disable_plugin,
                "engine_start_s": [],
                "wrappers": report.get("wrappers", []),
                "compilation_mode": report.get("compilation_mode"),
                "dynamo_graphs": report.get("dynamo_graphs"),
                "worker_threads": report["threads"],
                "op_calls_after_warmup": report.get("calls", {}),
                "prompt_tokens": warm["prompt_tokens"],
                "log_facts": _log_facts(log),
            },
        )
        entry["engine_start_s"].append(ready["engine_start_s"])
        print(
            f"  engine start {ready['engine_start_s']:.0f} s; wrapper "
            f"{report.get('wrappers') or 'none'}; mode "
            f"{report.get('compilation_mode')}, "
            f"{report.get('dynamo_graphs')} dynamo graph(s); "
            f"{report['threads']['torch_threads']} worker thread(s); "
            f"routing {'OK' if not problems else problems}",
            flush=True,
        )
        return child

    def measure(self, child: Child, row: dict[str, Any], label: str) -> None:
        """One t_1 and t_N pair of `child` into `row`."""
        from benchmarks import machine

        n, batch = self.settings.max_tokens, self.settings.batch
        load = machine.load_average()
        short = child.call("generate", max_tokens=1)
        long = child.call("generate", max_tokens=n)
        bad = [c for c in long["output_tokens"] if c != n]
        if bad:
            raise RuntimeError(
                f"{child.config.name}: {len(bad)} requests stopped early "
                f"({bad[:4]} tokens, not {n})"
            )
        rates = _rates(batch, n, short, long)
        row[child.config.name] = rates | {"load_1min": load}
        print(
            f"  {label} {child.config.name:>10}: prefill+1 "
            f"{rates['t1_s']:6.2f} s, {n} tokens {rates['tN_s']:6.2f} s -> "
            f"decode {rates['decode_tok_s']:7.2f} tok/s, prefill "
            f"{rates['prefill_tok_s']:7.1f} tok/s",
            flush=True,
        )

    def profile(self, child: Child) -> None:
        """One more N-token run of `child` under torch.profiler."""
        n = self.settings.max_tokens
        print(f"Profiling {child.config.name} ({n} tokens) ...", flush=True)
        prof = child.call("profile", max_tokens=n, top=30)
        self.result.setdefault("profiles", {})[child.config.name] = prof[
            "profile"
        ]

    def finish_child(self, child: Child) -> None:
        """Records a child's op counters after all its runs."""
        report = child.call("report")
        self.result["configs"][child.config.name]["op_calls_total"] = (
            report.get("calls", {})
        )


def _new_row(settings: Settings, r: int) -> tuple[dict[str, Any], str]:
    """A round's row, with the load at its start, and its label.

    With ``--max-load``, first waits (polling every minute, at most
    ``--max-wait`` s) for the 1-minute load average to drop below it: the
    cores are shared, and other work skews whichever configuration it
    overlaps.
    """
    from benchmarks import machine

    waited = 0.0
    if settings.max_load is not None:
        t0 = time.monotonic()
        while (
            machine.load_average() >= settings.max_load
            and time.monotonic() - t0 < settings.max_wait
        ):
            print(
                f"  load {machine.load_average():.2f} >= "
                f"{settings.max_load}: waiting ...",
                flush=True,
            )
            time.sleep(60)
        waited = time.monotonic() - t0
    row = {"load_1min": machine.load_average(), "waited_s": waited}
    return row, f"round {r + 1}/{settings.rounds}"


def run(settings: Settings, models: dict[str, Any]) -> dict[str, Any]:
    """Starts the children, warms up, measures; returns the raw results."""
    adapters = models["adapters"]
    spec = {
        "model": models["base"],
        "adapters": adapters,
        "max_lora_rank": settings.rank,
        "max_model_len": settings.max_len,
        "prompts": prompts(settings.batch),
        "assign": settings.assign,
        "llm_args": {
            "enforce_eager": settings.enforce_eager,
            "max_num_batched_tokens": settings.batched_tokens,
        },
    }
    configs = [c for c in CONFIGS if c.name in settings.configs]
    with tempfile.TemporaryDirectory(prefix="vcl_vllm_e2e_") as tmp:
        runner = Runner(settings, spec, pathlib.Path(tmp))
        if settings.fresh_children:
            _run_fresh(runner, configs)
        else:
            _run_together(runner, configs)
    return runner.result


def _run_together(runner: Runner, configs: list[Config]) -> None:
    """All children alive at once; rounds take turns in rotating order."""
    settings = runner.settings
    children: list[Child] = []
    try:
        for config in configs:
            children.append(runner.start(config))
        for r in range(settings.rounds):
            k = r % len(children)
            row, label = _new_row(settings, r)
            for child in children[k:] + children[:k]:
                time.sleep(SETTLE_S)
                runner.measure(child, row, label)
            runner.result["rounds"].append(row)
        if settings.profile:
            for child in children:
                runner.profile(child)
        for child in children:
            runner.finish_child(child)
    finally:
        for child in children:
            child.close()


def _run_fresh(runner: Runner, configs: list[Config]) -> None:
    """One child at a time: per round, each configuration's fresh child,
    in an order rotating over rounds (profiled in the last round)."""
    settings = runner.settings
    for r in range(settings.rounds):
        k = r % len(configs)
        row, label = _new_row(settings, r)
        for config in configs[k:] + configs[:k]:
            child = runner.start(config)
            try:
                runner.measure(child, row, label)
                if settings.profile and r == settings.rounds - 1:
                    runner.profile(child)
                runner.finish_child(child)
            finally:
                child.close()
        runner.result["rounds"].append(row)
