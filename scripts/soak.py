#!/usr/bin/env python3
"""Soak test: `vllm serve` with LoRA under load and adapter churn.

Usage, from the checkout in the vLLM environment:
  .venv-vllm/bin/python scripts/soak.py [--requests 400] [--concurrency 12]
      [--max-tokens 16] [--time-limit 900] [--plugin on|off|both]
      [--workdir DIR] [--json FILE]

One fp32 `vllm serve` of the tiny local Llama (vllm_cpu_lora.tiny_model)
with 8 PEFT adapters of different ranks and target modules, `--max-loras 2`
and `--max-cpu-loras 4`, so both the adapter slots and vLLM's CPU cache of
adapters churn all the time. A warm-up pass sends every (prompt, model)
once; then a fixed number of greedy completions, spread at random over the
8 adapters and the base model, go out a few at a time while one thread
unloads and reloads two of the adapters through the API. Checked:

* every request gets an HTTP response: 200, or vLLM's 404 for a request to
  a churned adapter while it is unloaded (counted apart);
* every 200's tokens are Hugging Face transformers + peft's greedy tokens
  (fp32) for its own model, and the 9 models' tokens differ on every
  prompt, so an answer from the wrong adapter cannot pass;
* every runtime unload and load succeeds;
* the RSS of the server's processes after warm-up stays within
  `RSS_TOLERANCE_KIB` (peak and end against the first sample);
* no process of the server is left after it stopped.

It reports requests/s and the p50/p99 latency; `--plugin both` (the
default) runs the same schedule with VLLM_CPU_LORA_DISABLE=1 after it, for
contrast. Exit status 1 if the plug-in's run fails a check (the contrast
run is only reported: vLLM 0.32's own ops give base-model rows batched with
adapter rows the last slot's adapter, see docs/vllm.md). A test and ops
tool, not part of the package; tests/test_vllm_soak.py runs a short one,
docs/reliability.md has the figures.
"""

import argparse
import dataclasses
import importlib.metadata
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The checkout's package (the one under test), not a copy installed earlier.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vllm_cpu_lora import tiny_model  # noqa: E402
from vllm_cpu_lora.server import VllmServer, live_group_members  # noqa: E402

BASE = "base"
# name -> (rank, target modules): ranks 1 to 16 (max_lora_rank 16), and
# attention-only, MLP-only and mixed subsets, so that vLLM's slots hold
# adapters of unlike shapes, some layers with no LoRA at all.
ADAPTERS = {
    "lora-1": (16, tiny_model.LORA_TARGETS),
    "lora-2": (8, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "lora-3": (4, ("gate_proj", "up_proj", "down_proj")),
    "lora-4": (12, ("q_proj", "v_proj")),
    "lora-5": (2, ("o_proj", "down_proj")),
    "lora-6": (6, ("k_proj", "up_proj")),
    "lora-7": (16, ("v_proj", "gate_proj")),
    "lora-8": (1, tiny_model.LORA_TARGETS),
}
# Adapter name -> its PEFT directory.
Adapters = dict[str, str | os.PathLike]
# Unloaded and reloaded through the API during the run.
CHURNED = ("lora-7", "lora-8")
# How long a churned adapter stays unloaded, then loaded, per cycle.
_UNLOADED_S = 0.3
_LOADED_S = 0.7
_RSS_PERIOD_S = 1.0
# The server's RSS may move this much after warm-up: 2% of the ~2.9 GiB its
# processes hold. Measured (docs/reliability.md): vLLM 0.33 moves by 3-12
# MiB in a 400-request run; vLLM 0.32's worker grows by ~20 KiB a request,
# slowing down, with or without the plug-in (~20-25 MiB in 400 requests,
# ~60 MiB in 3000), so runs much longer than 1000 requests exceed it there.
RSS_TOLERANCE_KIB = 64 * 1024


@dataclasses.dataclass
class Response:
    """One completion request's outcome."""

    model: str
    prompt: str
    status: int  # HTTP status; 0 when no response came (error says why)
    latency_s: float
    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def sequence(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """(model, prompt token ids, token ids): what HF checks."""
        return self.model, tuple(self.prompt_tokens), tuple(self.tokens)


@dataclasses.dataclass
class SoakResult:
    """What one soak run measured and found."""

    plugin: bool
    vllm: str
    requests: int
    concurrency: int
    max_tokens: int
    wall_s: float
    requests_per_s: float
    p50_s: float
    p99_s: float
    served: int  # 200 with its own model's greedy tokens
    refused_unloaded: int  # 404 for a churned adapter while unloaded
    wrong: list[str]  # 200 with tokens that are not its model's
    failed: list[str]  # no response, or any other status
    indistinct: list[str]  # prompts on which two models' tokens agree
    churn_calls: int
    churn_failed: list[str]
    rss_kib: list[int]  # after warm-up, then every _RSS_PERIOD_S, the end
    left: list[int]  # server processes alive after stop

    @property
    def rss_drift_kib(self) -> int:
        """The largest move of the RSS from its first sample."""
        return max(abs(kib - self.rss_kib[0]) for kib in self.rss_kib)

    def problems(self) -> list[str]:
        """Every failed check, one line each; empty when all passed."""
        found = [f"wrong tokens: {w}" for w in self.wrong]
        found += [f"no good response: {f}" for f in self.failed]
        found += [f"models agree: {i}" for i in self.indistinct]
        found += [f"churn call failed: {c}" for c in self.churn_failed]
        if self.rss_drift_kib > RSS_TOLERANCE_KIB:
            found.append(
                f"RSS moved {self.rss_drift_kib} KiB after warm-up "
                f"(tolerance {RSS_TOLERANCE_KIB} KiB): {self.rss_kib}"
            )
        if self.left:
            found.append(f"server processes left: {self.left}")
        return found


def build_models(work: Path) -> tuple[Path, Adapters]:
    """The tiny Llama and the ADAPTERS under `work`."""
    base = tiny_model.build_tiny_llama(work / "tiny-llama")
    adapters: Adapters = {
        name: tiny_model.build_lora_adapter(
            base, work / name, seed=seed, rank=rank, targets=targets
        )
        for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), 1)
    }
    return base, adapters


def group_rss_kib(pgid: int) -> int:
    """The summed VmRSS of process group `pgid`'s live members, in KiB."""
    total = 0
    for pid in live_group_members(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # it exited since it was listed
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def _complete(
    server: VllmServer,
    model: str,
    prompt: str,
    max_tokens: int,
    deadline: float,
) -> Response:
    if time.monotonic() > deadline:
        return Response(model, prompt, 0, 0.0, error="not sent: time is up")
    start = time.perf_counter()
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    try:
        status, text = server.request("POST", "/v1/completions", body)
        latency = time.perf_counter() - start
        if status != 200:
            return Response(model, prompt, status, latency, error=text)
        choice = json.loads(text)["choices"][0]
    except Exception as e:  # any failure is a lost request: counted
        return Response(
            model, prompt, 0, time.perf_counter() - start, error=repr(e)
        )
    return Response(
        model,
        prompt,
        status,
        latency,
        list(choice["prompt_token_ids"]),
        list(choice["token_ids"]),
    )


def _send_all(
    server: VllmServer,
    requests: Sequence[tuple[str, str]],
    concurrency: int,
    max_tokens: int,
    deadline: float,
) -> list[Response]:
    """The (model, prompt) requests, at most `concurrency` in flight;
    those not sent by `deadline` (time.monotonic) fail."""

    def send(request: tuple[str, str]) -> Response:
        return _complete(server, *request, max_tokens, deadline)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(send, requests))


def _churn(
    server: VllmServer,
    paths: Adapters,
    stop: threading.Event,
    calls: list[tuple[str, int, str]],
) -> None:
    """Unloads and reloads each adapter of `paths` in turn until `stop`."""
    for name in itertools.cycle(paths):
        steps = (
            ("unload", {"lora_name": name}, _UNLOADED_S),
            (
                "load",
                {"lora_name": name, "lora_path": str(paths[name])},
                _LOADED_S,
            ),
        )
        for action, body, pause in steps:
            try:
                status, text = server.request(
                    "POST", f"/v1/{action}_lora_adapter", body
                )
            except OSError as e:
                status, text = 0, repr(e)
            calls.append((f"{action} {name}", status, text))
            if stop.wait(pause):
                return


def _refused_while_unloaded(response: Response) -> bool:
    """Whether it is vLLM's 404 for a churned adapter (unloaded then)."""
    return (
        response.status == 404
        and response.model in CHURNED
        and "does not exist" in response.error
    )


def _sample_rss(pgid: int, stop: threading.Event, samples: list[int]) -> None:
    while not stop.wait(_RSS_PERIOD_S):
        samples.append(group_rss_kib(pgid))


def _check_tokens(
    base: Path,
    adapters: Adapters,
    responses: Sequence[Response],
    max_tokens: int,
) -> tuple[list[bool], list[str]]:
    """Per 200 response, whether its tokens are HF's greedy ones for its
    model; and the prompts on which two models' greedy tokens agree or a
    model has none."""
    ok = [r for r in responses if r.status == 200]
    sequences = sorted({r.sequence for r in ok})  # each checked once
    logits = tiny_model.hf_next_token_logits(
        base,
        adapters,
        [(p, t, None if m == BASE else m) for m, p, t in sequences],
    )
    greedy = {
        seq
        for seq, lg in zip(sequences, logits, strict=True)
        if len(seq[2]) == max_tokens and list(seq[2]) == lg.argmax(-1).tolist()
    }
    indistinct = []
    for prompt in dict.fromkeys(r.prompt for r in ok):
        outputs = {
            r.model: r.sequence[2]
            for r in ok
            if r.prompt == prompt and r.sequence in greedy
        }
        models = 1 + len(adapters)
        if len(outputs) != models or len(set(outputs.values())) != models:
            indistinct.append(f"{prompt!r}: {outputs}")
    return [r.sequence in greedy for r in ok], indistinct


def run_soak(
    base: Path,
    adapters: Adapters,
    *,
    work: Path,
    requests: int = 400,
    concurrency: int = 12,
    max_tokens: int = 16,
    disable_plugin: bool = False,
    seed: int = 0,
    time_limit_s: float = 900.0,
) -> SoakResult:
    """One soak run (see the module doc) on a fresh server; requests not
    sent within `time_limit_s` of its start fail."""
    models = [BASE, *adapters]
    prompts = tiny_model.PROMPTS
    rng = random.Random(seed)
    schedule = [
        (rng.choice(models), rng.choice(prompts)) for _ in range(requests)
    ]
    server = VllmServer(
        base,
        adapters=adapters,
        log_path=work / f"serve-{'off' if disable_plugin else 'on'}.log",
        dtype="float32",
        max_lora_rank=16,
        max_loras=2,
        extra_args=["--served-model-name", BASE, "--max-cpu-loras", "4"],
        disable_plugin=disable_plugin,
    )
    stop = threading.Event()
    churn_calls: list[tuple[str, int, str]] = []
    deadline = time.monotonic() + time_limit_s
    with server:
        assert server.pgid is not None
        warmup = _send_all(
            server,
            [(m, p) for p in prompts for m in models],
            concurrency,
            max_tokens,
            deadline,
        )
        rss = [group_rss_kib(server.pgid)]
        threads = [
            threading.Thread(
                target=_churn,
                args=(
                    server,
                    {n: adapters[n] for n in CHURNED},
                    stop,
                    churn_calls,
                ),
            ),
            threading.Thread(target=_sample_rss, args=(server.pgid, stop, rss)),
        ]
        for thread in threads:
            thread.start()
        start = time.perf_counter()
        try:
            measured = _send_all(
                server, schedule, concurrency, max_tokens, deadline
            )
        finally:
            wall_s = time.perf_counter() - start
            stop.set()
            for thread in threads:
                thread.join()
        rss.append(group_rss_kib(server.pgid))
    left = live_group_members(server.pgid)

    verdicts, indistinct = _check_tokens(
        base, adapters, [*warmup, *measured], max_tokens
    )
    answered = [r for r in [*warmup, *measured] if r.status == 200]
    wrong = [
        f"{r.model} {r.prompt!r} -> {r.tokens}"
        for r, good in zip(answered, verdicts, strict=True)
        if not good
    ]
    # Churn starts after warm-up: only then may a 404 be expected.
    refused = [r for r in measured if _refused_while_unloaded(r)]
    failed = [
        f"{r.model} {r.prompt!r}: HTTP {r.status} {r.error[:300]}"
        for r in [*warmup, *measured]
        if r.status != 200 and r not in refused
    ]
    latencies = [r.latency_s for r in measured if r.status == 200]
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return SoakResult(
        plugin=not disable_plugin,
        vllm=importlib.metadata.version("vllm"),
        requests=requests,
        concurrency=concurrency,
        max_tokens=max_tokens,
        wall_s=wall_s,
        requests_per_s=requests / wall_s,
        p50_s=cuts[49],
        p99_s=cuts[98],
        served=len(answered) - len(wrong),
        refused_unloaded=len(refused),
        wrong=wrong,
        failed=failed,
        indistinct=indistinct,
        churn_calls=len(churn_calls),
        churn_failed=[
            f"{c}: HTTP {s} {t[:300]}" for c, s, t in churn_calls if s != 200
        ],
        rss_kib=rss,
        left=left,
    )


def _print(result: SoakResult) -> None:
    label = "plug-in" if result.plugin else "VLLM_CPU_LORA_DISABLE=1"
    print(
        f"\n== {label}, vLLM {result.vllm}: {result.requests} requests, "
        f"{result.concurrency} at a time, {result.max_tokens} tokens each\n"
        f"  {result.requests_per_s:.2f} requests/s, latency p50 "
        f"{result.p50_s:.3f} s, p99 {result.p99_s:.3f} s\n"
        f"  served right {result.served} (warm-up included), refused while "
        f"unloaded {result.refused_unloaded}, wrong tokens "
        f"{len(result.wrong)}, failed {len(result.failed)}\n"
        f"  runtime unload/load calls {result.churn_calls}, failed "
        f"{len(result.churn_failed)}\n"
        f"  RSS after warm-up {result.rss_kib[0] / 1024:.0f} MiB, peak "
        f"{max(result.rss_kib) / 1024:.0f} MiB, end "
        f"{result.rss_kib[-1] / 1024:.0f} MiB (largest move "
        f"{result.rss_drift_kib / 1024:.1f} MiB, tolerance "
        f"{RSS_TOLERANCE_KIB / 1024:.0f} MiB)\n"
        f"  server processes left: {len(result.left)}"
    )
    for problem in result.problems():
        print(f"  PROBLEM: {problem}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/soak.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--time-limit",
        type=float,
        default=900.0,
        help="seconds per run, from the server's start (default 900)",
    )
    parser.add_argument(
        "--plugin", choices=["on", "off", "both"], default="both"
    )
    parser.add_argument("--workdir", help="default: a new temporary directory")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vllm_cpu_lora_soak_") as tmp:
        work = Path(args.workdir or tmp)
        base, adapters = build_models(work)
        results = [
            run_soak(
                base,
                adapters,
                work=work,
                requests=args.requests,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                disable_plugin=disable,
                time_limit_s=args.time_limit,
            )
            for disable in {
                "on": [False],
                "off": [True],
                "both": [False, True],
            }[args.plugin]
        ]
    for result in results:
        _print(result)
    if len(results) == 2:
        on, off = results
        print(
            f"\nplug-in / vLLM's own ops: requests/s "
            f"{on.requests_per_s / off.requests_per_s:.2f}x, p50 latency "
            f"{on.p50_s / off.p50_s:.2f}x, p99 {on.p99_s / off.p99_s:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps([dataclasses.asdict(r) for r in results], indent=1)
        )
    return 1 if any(r.plugin and r.problems() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
