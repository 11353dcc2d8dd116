"""vLLM's offline `LLM.generate` in a child process, as a JSON spec says.

Each vLLM configuration runs in a fresh process (``python -m
vllm_cpu_lora.offline --run-spec SPEC --out RESULT``), because the plug-in
decides per process and vLLM's engine spawns processes of its own. The vLLM
tests and the demo's ``--offline`` mode use it.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_cpu_lora import plugin
from vllm_cpu_lora.tiny_model import PROMPTS

__all__ = ["child_env", "demo", "run_vllm_child"]


def child_env(disable_plugin: bool = False) -> dict[str, str]:
    """The environment for a vLLM child process: offline, small KV cache,
    worker reports allowed, our plug-in on or off."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # LLM.collective_rpc sends worker_lora_report, a function, to
            # the engine's worker: vLLM pickles functions only with this.
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        }
    )
    if disable_plugin:
        env["VLLM_CPU_LORA_DISABLE"] = "1"
    else:
        env.pop("VLLM_CPU_LORA_DISABLE", None)
    # The child must import this package as the parent does.
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def run_vllm_child(
    spec: dict[str, Any],
    *,
    disable_plugin: bool = False,
    timeout: float = 900,
    log_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Runs `spec` (see `_run_spec`) in a fresh Python process.

    Returns:
        The child's result; ``result["log"]`` holds its combined output.
    """
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp, "spec.json")
        out_file = Path(tmp, "result.json")
        spec_file.write_text(json.dumps(spec))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "vllm_cpu_lora.offline",
                "--run-spec",
                str(spec_file),
                "--out",
                str(out_file),
            ],
            env={**child_env(disable_plugin), **spec.get("env", {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
        if log_path is not None:
            Path(log_path).write_text(proc.stdout)
        if not out_file.exists():
            raise RuntimeError(
                f"vLLM child exited with {proc.returncode} and no result; "
                f"its output ends with:\n{proc.stdout[-6000:]}"
            )
        result = json.loads(out_file.read_text())
    result["log"] = proc.stdout
    result["returncode"] = proc.returncode
    return result


def _run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs vLLM in this process as `spec` says; returns a JSON-able result.

    spec keys: ``model``; ``adapters`` (name -> path; IDs follow the order);
    ``batches``: lists of [prompt, adapter name or null]; ``max_tokens``;
    ``dtype``; ``max_lora_rank``; ``max_loras``; optional ``warmup`` (a
    batch run first, untimed), ``ignore_eos`` (default true: every
    completion has ``max_tokens`` tokens), ``llm_args`` (more `LLM`
    arguments, e.g. ``{"enforce_eager": false, "tensor_parallel_size":
    2}``; eager by default) and ``env`` (variables `run_vllm_child` adds to
    the child's environment, e.g. vLLM's CPU thread binding). Errors in
    building the engine or generating are returned as ``{"error": "Type:
    message"}``. ``reports`` holds `worker_lora_report` of every worker
    (one per rank), ``report`` the first.
    """
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_cpu_lora.punica import worker_lora_report

    result: dict[str, Any] = {"error": None, "batches": []}
    adapters = {
        name: LoRARequest(name, i + 1, str(path))
        for i, (name, path) in enumerate(spec["adapters"].items())
    }
    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec["max_tokens"],
        ignore_eos=spec.get("ignore_eos", True),
    )
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=spec["model"],
            dtype=spec["dtype"],
            enable_lora=True,
            max_loras=spec.get("max_loras", 2),
            max_lora_rank=spec["max_lora_rank"],
            seed=0,
            **{"max_model_len": 256, "enforce_eager": True}
            | spec.get("llm_args", {}),
        )
    except Exception as e:  # reported to the parent
        result["error"] = f"{type(e).__name__}: {e}"
        return result
    result["engine_start_s"] = time.perf_counter() - t0

    def generate(batch):
        prompts = [prompt for prompt, _ in batch]
        loras = [None if a is None else adapters[a] for _, a in batch]
        return llm.generate(prompts, params, lora_request=loras, use_tqdm=False)

    try:
        if spec.get("warmup"):
            generate(spec["warmup"])
        for batch in spec["batches"]:
            t = time.perf_counter()
            outputs = generate(batch)
            elapsed = time.perf_counter() - t
            result["batches"].append(
                {
                    "elapsed_s": elapsed,
                    "outputs": [
                        {
                            "prompt_token_ids": list(o.prompt_token_ids),
                            "token_ids": list(o.outputs[0].token_ids),
                            "text": o.outputs[0].text,
                        }
                        for o in outputs
                    ],
                }
            )
    except Exception as e:  # reported to the parent
        result["error"] = f"{type(e).__name__}: {e}"
        return result
    result["reports"] = llm.collective_rpc(worker_lora_report)
    result["report"] = result["reports"][0]
    return result


def _child_main(spec_file: str, out_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    result = _run_spec(spec)
    Path(out_file).write_text(json.dumps(result))
    return 0


def _tokens_per_s(batch: dict[str, Any]) -> tuple[int, float]:
    tokens = sum(len(o["token_ids"]) for o in batch["outputs"])
    return tokens, tokens / batch["elapsed_s"]


def demo(base: Path, adapters: dict[str, str], args: argparse.Namespace) -> int:
    """The offline demo: LLM.generate with each adapter, none and mixed.

    Args:
        base: The model (`tiny_model.build_tiny_llama`).
        adapters: "adapter-1" and "adapter-2" -> PEFT adapter directory.
        args: The demo's command line (dtype, max_tokens, batch_size,
            compare).
    """
    adapters = {name: adapters[name] for name in ("adapter-1", "adapter-2")}
    choices = [None, "adapter-1", "adapter-2"]
    prompts = PROMPTS[: args.batch_size]
    batches = [[(prompt, adapter) for prompt in prompts] for adapter in choices]
    batches.append([(p, choices[i % 3]) for i, p in enumerate(prompts)])
    labels = ["no adapter", "adapter-1", "adapter-2", "mixed batch"]
    spec = {
        "model": str(base),
        "adapters": adapters,
        "batches": batches,
        "warmup": [(PROMPTS[0], a) for a in choices],
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "max_lora_rank": 16,
        "max_loras": 2,
    }

    runs = [("vllm_cpu_lora plug-in", False)]
    if args.compare:
        runs.append(("vLLM's own ops (VLLM_CPU_LORA_DISABLE=1)", True))
    results = []
    for title, disable in runs:
        print(
            f"\n=== {title}: dtype {args.dtype}, {len(prompts)} prompts x "
            f"{args.max_tokens} tokens per batch, greedy"
        )
        res = run_vllm_child(spec, disable_plugin=disable)
        if res["error"]:
            fd, log = tempfile.mkstemp(
                prefix="vllm_cpu_lora_demo_", suffix=".log"
            )
            with os.fdopen(fd, "w") as f:
                f.write(res["log"])
            print(res["log"][-4000:])
            print(f"vLLM failed: {res['error']} (its whole log: {log})")
            return 1
        report = res["report"]
        print(
            f"engine start {res['engine_start_s']:.1f} s; LoRA wrapper: "
            f"{', '.join(report['wrappers'])}"
        )
        if not disable and plugin.WRAPPER not in report["wrappers"]:
            print(
                "WARNING: vLLM did not use the vllm_cpu_lora plug-in: is "
                "this package installed in vLLM's environment?"
            )
        if report["calls"]:
            calls = ", ".join(
                f"{k} {v}" for k, v in sorted(report["calls"].items())
            )
            print(f"vllm_cpu_lora op calls: {calls}")
        for label, requests, batch in zip(
            labels, batches, res["batches"], strict=True
        ):
            tokens, rate = _tokens_per_s(batch)
            print(
                f"\n[{label}] {tokens} tokens in {batch['elapsed_s']:.3f} s "
                f"= {rate:.1f} tokens/s"
            )
            for (prompt, adapter), out in zip(
                requests, batch["outputs"], strict=True
            ):
                print(
                    f"  {adapter or 'base':>9} | {prompt!r} -> {out['text']!r}"
                )
        results.append(res)

    if args.compare:
        ours, theirs = (
            [
                t
                for b in r["batches"]
                for o in b["outputs"]
                for t in o["token_ids"]
            ]
            for r in results
        )
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        print("\ntokens/s, vllm_cpu_lora vs vLLM's own ops:")
        for i, label in enumerate(labels):
            mine = _tokens_per_s(results[0]["batches"][i])[1]
            other = _tokens_per_s(results[1]["batches"][i])[1]
            print(
                f"  {label:>12}: {mine:8.1f} vs {other:8.1f} "
                f"({mine / other:.2f}x)"
            )
        print(f"identical tokens: {same} of {len(ours)}")
        if same < len(ours):
            print(_why_tokens_differ(args.dtype))
    return 0


def _why_tokens_differ(dtype: str) -> str:
    import vllm

    from vllm_cpu_lora import vllm_compat

    if vllm_compat.torch_ops_misapply_no_lora(vllm.__version__):
        return (
            f"(vLLM {vllm.__version__}'s own ops add the last slot's adapter "
            "to base-model rows batched with adapter rows: see the mixed "
            "batch; vLLM 0.33 fixed it)"
        )
    if dtype != "float32":
        return (
            "(the paths round bf16 differently and greedy decoding follows "
            "the first difference; --dtype float32 agrees exactly)"
        )
    return "(float32 should agree exactly: this is a bug)"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_cpu_lora.offline")
    parser.add_argument("--run-spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    return _child_main(args.run_spec, args.out)


if __name__ == "__main__":
    sys.exit(main())
