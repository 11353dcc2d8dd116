"""CPU vLLM serving a tiny local Llama with LoRA adapters through our kernels.

Run: ``python -m vllm_cpu_lora.demo`` in an environment with CPU vLLM and
this package installed (scripts/demo.sh sets one up), so that vLLM finds the
`vllm.general_plugins` entry point.

It takes a tiny Llama that answers questions about animals and two LoRA
adapters, one answering in capitals and one turning the question into SQL
(`vllm_cpu_lora.train`: trained locally in about a minute the first time,
then cached; no model hub). It starts ``vllm serve`` on localhost with the
first adapter as ``--lora-modules`` and, with the `openai` client, sends
concurrent completions for it and the base model, printing each answer, the
latency per model and the tokens/s. Then it loads the second adapter at run
time (``POST /v1/load_lora_adapter``), prints each question answered by the
base model and by each adapter side by side, measures each model's accuracy
on every task over the held-out questions through the server, and unloads
the adapter. The server is stopped, with every process it started, on
success, on an error and on Ctrl-C. ``--offline`` runs vLLM's offline
``LLM.generate`` on a random-weight model and random adapters instead
(``--compare`` there also runs vLLM's own torch ops and compares tokens).
"""

import argparse
import io
import json
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from vllm_cpu_lora import offline, tiny_model, toy_tasks, train
from vllm_cpu_lora.server import VllmServer

__all__ = ["BASE_MODEL", "build_models", "main", "serve_and_query"]

BASE_MODEL = "tiny-llama"
PLUGIN_LOG_LINE = "vllm_cpu_lora: LoRA on CPU uses"


def build_models(
    work: Path, *, hidden_size: int = 256, num_layers: int = 2
) -> tuple[Path, dict[str, str]]:
    """The tiny Llama and adapters 1-3 (ranks 8, 16 and 4) under `work`."""
    heads = max(1, hidden_size // 64)
    base = tiny_model.build_tiny_llama(
        work / "tiny-llama",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        intermediate_size=2 * hidden_size,
    )
    adapters = {
        f"adapter-{i}": str(
            tiny_model.build_lora_adapter(
                base, work / f"lora-{i}", seed=i, rank=rank
            )
        )
        for i, rank in ((1, 8), (2, 16), (3, 4))
    }
    return base, adapters


def _complete(
    client: Any, model: str, prompt: str, max_tokens: int, stop_at_eos: bool
) -> dict:
    start = time.perf_counter()
    response = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": not stop_at_eos, "return_token_ids": True},
    )
    choice = response.choices[0]
    return {
        "model": model,
        "prompt": prompt,
        "text": choice.text,
        "prompt_token_ids": list(choice.model_extra["prompt_token_ids"]),
        "token_ids": list(choice.model_extra["token_ids"]),
        "latency_s": time.perf_counter() - start,
    }


def _burst(
    client: Any,
    requests: Sequence[tuple[str, str]],
    max_tokens: int,
    stop_at_eos: bool,
) -> tuple[list[dict], float]:
    """All (model, prompt) requests at once; (results, wall seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [
            pool.submit(
                _complete, client, model, prompt, max_tokens, stop_at_eos
            )
            for model, prompt in requests
        ]
        results = [f.result() for f in futures]
    return results, time.perf_counter() - start


def _print_burst(results: list[dict], wall_s: float) -> None:
    """Each prompt, then each model's answer to it side by side; then the
    latency and tokens/s per model."""
    for prompt in dict.fromkeys(r["prompt"] for r in results):
        print(f"  {prompt!r}")
        for r in results:
            if r["prompt"] == prompt:
                print(f"    {r['model']:>10} -> {r['text'].strip()!r}")
    print(f"\n  {'model':>10} | requests | mean latency | tokens/s")
    for model in dict.fromkeys(r["model"] for r in results):
        mine = [r for r in results if r["model"] == model]
        latency = sum(r["latency_s"] for r in mine) / len(mine)
        tokens = sum(len(r["token_ids"]) for r in mine)
        print(
            f"  {model:>10} | {len(mine):>8} | {latency:10.3f} s | "
            f"{tokens / latency / len(mine):8.1f} (per request)"
        )
    tokens = sum(len(r["token_ids"]) for r in results)
    print(
        f"  all {len(results)} requests: {tokens} tokens in {wall_s:.2f} s "
        f"= {tokens / wall_s:.1f} tokens/s"
    )


def serve_and_query(
    base: Path,
    adapters: dict[str, str],
    *,
    work: Path,
    dtype: str,
    prompts: Sequence[str],
    max_tokens: int,
    disable_plugin: bool = False,
    stop_at_eos: bool = False,
    accuracy_prompts: Sequence[str] = (),
) -> dict[str, Any]:
    """The demo's serving session, printed as it goes.

    Every adapter but the last is served from the start (``--lora-modules``)
    and the last is loaded at run time, used and unloaded.

    Args:
        base: The model.
        adapters: Name -> PEFT adapter directory, in that order.
        work: Where the server's log goes.
        dtype: The server's dtype.
        prompts: Asked of each model.
        max_tokens: Tokens per completion at most.
        disable_plugin: Sets VLLM_CPU_LORA_DISABLE=1 for the server.
        stop_at_eos: Whether a completion ends at the end-of-text token
            (else it has `max_tokens` tokens).
        accuracy_prompts: Also asked of each model, at once, while all
            adapters are loaded; the answers are returned, not printed.

    Returns:
        ``{"log_lines": plug-in lines of the server log, "burst": results
        for the base model and the adapters served from the start,
        "runtime": results for every model once the last adapter is
        loaded, "accuracy": model -> answers to `accuracy_prompts`,
        "after_unload": (HTTP status, text) of a request to the last
        adapter once unloaded, "pgid": the server's process group}``.
    """
    import openai

    *served, late = adapters
    log_path = work / "vllm-serve.log"
    print(f"Starting vllm serve (log: {log_path}) ...", flush=True)
    start = time.perf_counter()
    server = VllmServer(
        base,
        adapters={name: adapters[name] for name in served},
        log_path=log_path,
        dtype=dtype,
        max_loras=len(adapters),
        extra_args=["--served-model-name", BASE_MODEL],
        disable_plugin=disable_plugin,
    )
    with server:
        ready_s = time.perf_counter() - start
        print(f"server ready at {server.base_url} in {ready_s:.0f} s")
        lines = [
            line.strip()
            for line in server.log_text().splitlines()
            if PLUGIN_LOG_LINE in line
        ]
        print(
            "server log:", *(lines or ["(no vllm_cpu_lora line)"]), sep="\n  "
        )
        client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0
        )
        requests = [
            (model, prompt)
            for prompt in prompts
            for model in (BASE_MODEL, *served)
        ]
        print(
            f"\n=== {len(requests)} concurrent completions (dtype {dtype}, "
            f"up to {max_tokens} tokens each, greedy)"
        )
        burst, wall_s = _burst(client, requests, max_tokens, stop_at_eos)
        _print_burst(burst, wall_s)

        print(f"\n=== {late} loaded at run time")
        status, text = server.request(
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": late, "lora_path": adapters[late]},
        )
        print(f"  POST /v1/load_lora_adapter: {status} {text.strip()}")
        models = [m.id for m in client.models.list().data]
        print(f"  models served: {', '.join(models)}")
        runtime, wall_s = _burst(
            client,
            [(model, p) for p in prompts for model in models],
            max_tokens,
            stop_at_eos,
        )
        _print_burst(runtime, wall_s)
        answers = (
            _burst(
                client,
                [(model, p) for model in models for p in accuracy_prompts],
                max_tokens,
                stop_at_eos,
            )[0]
            if accuracy_prompts
            else []
        )
        status, text = server.request(
            "POST", "/v1/unload_lora_adapter", {"lora_name": late}
        )
        print(f"  POST /v1/unload_lora_adapter: {status} {text.strip()}")
        after_unload = server.request(
            "POST",
            "/v1/completions",
            {"model": late, "prompt": prompts[0], "max_tokens": 1},
        )
        print(
            f"  {late} after unloading: HTTP {after_unload[0]} "
            f"{json.loads(after_unload[1]).get('error', {}).get('message')}"
        )
    print("\nserver stopped; none of its processes is left")
    return {
        "log_lines": lines,
        "burst": burst,
        "runtime": runtime,
        "accuracy": {
            model: [r["text"] for r in answers if r["model"] == model]
            for model in models
        },
        "after_unload": after_unload,
        "pgid": server.pgid,
    }


def _own_scores(accuracy: dict[str, dict[str, float]]) -> str:
    """Each model's accuracy on its own task, as "base 100%, ..."."""
    return ", ".join(
        f"{model} {row[train.task_of(model)]:.0%}"
        for model, row in accuracy.items()
    )


def _print_accuracy(
    accuracy: dict[str, dict[str, float]], questions: int, hf: str
) -> None:
    """The model x task table of held-out accuracies, then the summary."""
    tasks = list(toy_tasks.TASKS)
    print(f"\n=== accuracy over {questions} held-out questions, model x task")
    print(f"  {'model':>10} | " + " | ".join(f"{t:>7}" for t in tasks))
    for model, row in accuracy.items():
        print(f"  {model:>10} | " + " | ".join(f"{row[t]:7.0%}" for t in tasks))
    others = max(
        acc
        for model, row in accuracy.items()
        for task, acc in row.items()
        if task != train.task_of(model)
    )
    print(
        f"summary: on its own task, through the server: "
        f"{_own_scores(accuracy)} (HF + peft: {hf}); on another's task: at "
        f"most {others:.0%}"
    )


def _run(work: Path, args: argparse.Namespace) -> int:
    if args.offline:
        print(
            f"Building a random-weight tiny Llama (hidden {args.hidden_size}, "
            f"{args.num_layers} layers) and three LoRA adapters in {work} ...",
            flush=True,
        )
        base, adapters = build_models(
            work, hidden_size=args.hidden_size, num_layers=args.num_layers
        )
        return offline.demo(base, adapters, args)
    print(
        f"Tiny Llama and adapters {', '.join(train.ADAPTERS)}: from "
        f"{train.cache_root()}, or trained there now (about a minute on 2 "
        "idle cores) ...",
        flush=True,
    )
    start = time.perf_counter()
    models = train.ensure_models()
    report = models.report
    times = ", ".join(f"{m} {s:.0f} s" for m, s in report["train_s"].items())
    print(
        f"{'found in the cache' if report['cached'] else 'trained'} in "
        f"{time.perf_counter() - start:.0f} s (training: {times})"
    )
    _, held_out = toy_tasks.split(toy_tasks.facts())
    questions = [toy_tasks.question(f) for f in held_out]
    result = serve_and_query(
        models.base,
        models.adapters,
        work=work,
        dtype=args.dtype,
        prompts=questions[: args.batch_size],
        max_tokens=args.max_tokens,
        stop_at_eos=True,
        accuracy_prompts=questions,
    )
    served = {
        "base" if model == BASE_MODEL else model: answers
        for model, answers in result["accuracy"].items()
    }
    _print_accuracy(
        train.held_out_accuracies(served),
        len(questions),
        _own_scores(report["hf_accuracy"]),
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_cpu_lora.demo",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--workdir",
        help="where to build the model (default: a new temporary directory)",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"]
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=4,
        choices=range(1, len(tiny_model.PROMPTS) + 1),
        metavar="N",
        help=f"prompts per model, 1 to {len(tiny_model.PROMPTS)}",
    )
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=256,
        help="with --offline: the random model's width",
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=2,
        help="with --offline: the random model's layers",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="run vLLM's offline LLM.generate on a random-weight model "
        "instead of vllm serve",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="with --offline: also run vLLM's own CPU LoRA ops",
    )
    args = parser.parse_args(argv)
    # Progress shows as it happens, also through a pipe or into a file.
    # (typeshed types sys.stdout as TextIO, which has no reconfigure; the
    # interpreter's is a TextIOWrapper.)
    cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True)
    # SIGTERM stops the server too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.workdir:
            return _run(Path(args.workdir), args)
        with tempfile.TemporaryDirectory(prefix="vllm_cpu_lora_demo_") as tmp:
            return _run(Path(tmp), args)
    except KeyboardInterrupt:
        print("\ninterrupted; the server was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
