"""CPU vLLM serving a tiny local Llama with LoRA adapters through our kernels.

Run: ``python -m vllm_cpu_lora.demo`` in an environment with CPU vLLM and
this package installed (scripts/demo.sh sets one up), so that vLLM finds the
`vllm.general_plugins` entry point.

It builds a random-weight Llama and three random PEFT adapters locally (no
model hub, `vllm_cpu_lora.tiny_model`), starts ``vllm serve`` on localhost
with two of them as ``--lora-modules``, and, with the `openai` client, sends
concurrent completions for adapter 1, adapter 2 and the base model, printing
each output, the latency per model and the tokens/s. Then it loads the third
adapter at run time (``POST /v1/load_lora_adapter``), uses it, and unloads
it. The server is stopped, with every process it started, on success, on an
error and on Ctrl-C. ``--offline`` runs vLLM's offline ``LLM.generate``
instead (``--compare`` there also runs vLLM's own torch ops).
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

from vllm_cpu_lora import offline, tiny_model
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


def _complete(client: Any, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    response = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
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
    client: Any, requests: Sequence[tuple[str, str]], max_tokens: int
) -> tuple[list[dict], float]:
    """All (model, prompt) requests at once; (results, wall seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [
            pool.submit(_complete, client, model, prompt, max_tokens)
            for model, prompt in requests
        ]
        results = [f.result() for f in futures]
    return results, time.perf_counter() - start


def _print_burst(results: list[dict], wall_s: float) -> None:
    for r in results:
        print(f"  {r['model']:>10} | {r['prompt']!r} -> {r['text']!r}")
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
) -> dict[str, Any]:
    """The demo's serving session, printed as it goes.

    Returns:
        ``{"log_lines": plug-in lines of the server log, "burst": results
        for the base model, adapter-1 and adapter-2, "runtime": results for
        adapter-3 loaded at run time, "after_unload": (HTTP status, text) of
        a request to it once unloaded, "pgid": the server's process
        group}``.
    """
    import openai

    log_path = work / "vllm-serve.log"
    print(f"Starting vllm serve (log: {log_path}) ...", flush=True)
    start = time.perf_counter()
    server = VllmServer(
        base,
        adapters={n: adapters[n] for n in ("adapter-1", "adapter-2")},
        log_path=log_path,
        dtype=dtype,
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
            for model in (BASE_MODEL, "adapter-1", "adapter-2")
        ]
        print(
            f"\n=== {len(requests)} concurrent completions (dtype {dtype}, "
            f"{max_tokens} tokens each, greedy)"
        )
        burst, wall_s = _burst(client, requests, max_tokens)
        _print_burst(burst, wall_s)

        print("\n=== adapter-3 loaded at run time")
        status, text = server.request(
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "adapter-3", "lora_path": adapters["adapter-3"]},
        )
        print(f"  POST /v1/load_lora_adapter: {status} {text.strip()}")
        served = [m.id for m in client.models.list().data]
        print(f"  models served: {', '.join(served)}")
        runtime, wall_s = _burst(
            client, [("adapter-3", p) for p in prompts], max_tokens
        )
        _print_burst(runtime, wall_s)
        status, text = server.request(
            "POST", "/v1/unload_lora_adapter", {"lora_name": "adapter-3"}
        )
        print(f"  POST /v1/unload_lora_adapter: {status} {text.strip()}")
        after_unload = server.request(
            "POST",
            "/v1/completions",
            {"model": "adapter-3", "prompt": prompts[0], "max_tokens": 1},
        )
        print(
            f"  adapter-3 after unloading: HTTP {after_unload[0]} "
            f"{json.loads(after_unload[1]).get('error', {}).get('message')}"
        )
    print("\nserver stopped; none of its processes is left")
    return {
        "log_lines": lines,
        "burst": burst,
        "runtime": runtime,
        "after_unload": after_unload,
        "pgid": server.pgid,
    }


def _run(work: Path, args: argparse.Namespace) -> int:
    print(
        f"Building a tiny Llama (hidden {args.hidden_size}, "
        f"{args.num_layers} layers) and three LoRA adapters in {work} ...",
        flush=True,
    )
    base, adapters = build_models(
        work, hidden_size=args.hidden_size, num_layers=args.num_layers
    )
    if args.offline:
        return offline.demo(base, adapters, args)
    serve_and_query(
        base,
        adapters,
        work=work,
        dtype=args.dtype,
        prompts=tiny_model.PROMPTS[: args.batch_size],
        max_tokens=args.max_tokens,
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
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument(
        "--offline",
        action="store_true",
        help="run vLLM's offline LLM.generate instead of vllm serve",
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
