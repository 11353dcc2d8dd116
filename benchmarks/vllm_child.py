"""The vLLM child processes of the end-to-end benchmark, both sides.

``Child`` (parent side) starts ``python -m benchmarks.vllm_child SPEC`` with
a configuration's environment, sends it JSON commands on stdin and waits for
its replies; ``child_main`` (child side) builds vLLM's engine and serves the
commands. The ``worker_*`` functions run inside vLLM's worker through
``LLM.collective_rpc``: this module is the child's ``__main__``, so vLLM
pickles them by value and the worker need not import it.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.vllm_report import Config

_MODULE = "benchmarks.vllm_child"


class _NoKernels:
    """vllm_cpu_lora.ops with every op doing nothing (vllm_e2e.CONFIGS)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def worker_skip_kernels(worker: Any = None) -> None:
    """In a vLLM worker: our Punica wrapper calls no-op kernels from now on
    (for `LLM.collective_rpc`). Its outputs are then those of the base
    model, which is all a timing of LoRA's overhead needs."""
    from vllm_cpu_lora import punica

    punica.ops = _NoKernels()


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


def child_main(spec_file: str) -> int:
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
            enable_prefix_caching=False,
            seed=0,
            **kwargs,
            **spec["llm_args"],
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
        # No detokenizing: a preset's vocabulary can be larger than the
        # demo tokenizer's, and the text is not looked at.
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
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


class Child:
    """A long-lived vLLM child process serving one configuration."""

    def __init__(
        self,
        config: Config,
        spec: dict[str, Any],
        workdir: pathlib.Path,
        extra_env: dict[str, str | None] | None = None,
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
            [sys.executable, "-m", _MODULE, str(spec_file)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env(config.disable_plugin)
            | {k: v for k, v in (extra_env or {}).items() if v is not None},
            text=True,
            start_new_session=True,
        )
        self.seq = 0

    def log_text(self) -> str:
        """The child's output so far."""
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
        """Sends a command; returns its reply (see wait)."""
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


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
