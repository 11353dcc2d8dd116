"""Random-weight Llama models and LoRA adapters for the end-to-end benchmark.

Written tensor by tensor straight to safetensors shards, never as a whole
model in memory: Llama-2-7B shapes in bf16 are 13.5 GB, more than a shared
24 GiB machine can hold twice. The adapters are written the same way, in
PEFT's format, without loading the base model (PEFT would load it in
float32: 27 GB at 7B). Everything is cached under
``~/.cache/vllm-cpu-lora/bench-models`` (``$VLLM_CPU_LORA_CACHE``), so that
reruns skip building.

The tokenizer is always the demo's small byte-level BPE one
(`vllm_cpu_lora.tiny_model`): prompts then tokenize to ids below any
preset's vocabulary, and the model's own ``vocab_size`` alone sets the cost
of the embedding and the LM head.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from vllm_cpu_lora import tiny_model

# Bump when the models or adapters written below change.
_MODEL_VERSION = 2
_STD = 0.02  # transformers' Llama initializer_range
_SHARD_BYTES = 2 << 30

# The projections of a Llama layer that adapters may target, all of which
# the demo's adapters train; PEFT's default for Llama is q_proj and v_proj.
PROJECTIONS = tiny_model.LORA_TARGETS


def describe_targets(targets: Sequence[str]) -> str:
    """The adapters' projections in words, e.g. "q_proj and v_proj"."""
    if tuple(targets) == PROJECTIONS:
        return "all seven projections"
    *rest, last = (f"`{t}`" for t in targets)
    return f"{', '.join(rest)} and {last}" if rest else last


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Llama's shapes; ``vocab_size=None``: the demo tokenizer's."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int | None
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _cache_root() -> pathlib.Path:
    """Where the benchmark's models are kept between runs."""
    root = pathlib.Path(
        os.environ.get("VLLM_CPU_LORA_CACHE")
        or pathlib.Path.home() / ".cache" / "vllm-cpu-lora"
    )
    return root / "bench-models"


def _projections(shape: ModelShape) -> dict[str, tuple[str, int, int]]:
    """LoRA target -> (module path in a layer, in_features, out_features)."""
    h, i = shape.hidden_size, shape.intermediate_size
    kv = shape.num_kv_heads * shape.head_dim
    return {
        "q_proj": ("self_attn.q_proj", h, h),
        "k_proj": ("self_attn.k_proj", h, kv),
        "v_proj": ("self_attn.v_proj", h, kv),
        "o_proj": ("self_attn.o_proj", h, h),
        "gate_proj": ("mlp.gate_proj", h, i),
        "up_proj": ("mlp.up_proj", h, i),
        "down_proj": ("mlp.down_proj", i, h),
    }


def _base_tensors(
    shape: ModelShape, vocab: int
) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) of every tensor of the model, in file order."""
    h = shape.hidden_size
    yield "model.embed_tokens.weight", (vocab, h), False
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}."
        for module, fan_in, fan_out in _projections(shape).values():
            yield f"{prefix}{module}.weight", (fan_out, fan_in), False
        yield f"{prefix}input_layernorm.weight", (h,), True
        yield f"{prefix}post_attention_layernorm.weight", (h,), True
    yield "model.norm.weight", (h,), True
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", (vocab, h), False


def _write_sharded(
    path: pathlib.Path,
    tensors: Iterator[tuple[str, Any]],
    stem: str,
) -> None:
    """Saves (name, tensor) pairs as safetensors shards of ~2 GiB + index.

    Only one shard's tensors are in memory at a time.
    """
    from safetensors.torch import save_file

    shards: list[pathlib.Path] = []
    names: list[list[str]] = []  # per shard
    current: dict[str, Any] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            tmp = path / f"{stem}-part{len(shards)}.tmp"
            save_file(current, str(tmp), metadata={"format": "pt"})
            shards.append(tmp)
            names.append(list(current))
        current, size = {}, 0

    for name, tensor in tensors:
        current[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= _SHARD_BYTES:
            flush()
    flush()
    total = len(shards)
    if total == 1:
        os.replace(shards[0], path / f"{stem}.safetensors")
        return
    weight_map = {}
    for k, tmp in enumerate(shards):
        file = f"{stem}-{k + 1:05d}-of-{total:05d}.safetensors"
        os.replace(tmp, path / file)
        weight_map.update(dict.fromkeys(names[k], file))
    (path / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )


def write_base(path: pathlib.Path, shape: ModelShape, seed: int = 0) -> None:
    """Saves a random bf16 Llama of `shape` with the demo's tokenizer.

    Weights ~ N(0, 0.02) as transformers initialises a Llama, norms 1.
    """
    import torch
    from transformers import LlamaConfig

    from vllm_cpu_lora.tiny_model import build_tiny_llama

    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vcl_tok_") as tmp:
        tiny = build_tiny_llama(pathlib.Path(tmp) / "tiny", num_layers=1)
        for f in tiny.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, path / f.name)
        tiny_config = json.loads((tiny / "config.json").read_text())
    vocab = shape.vocab_size or tiny_config["vocab_size"]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=shape.rope_theta,
        initializer_range=_STD,
        bos_token_id=tiny_config["bos_token_id"],
        eos_token_id=tiny_config["eos_token_id"],
        tie_word_embeddings=shape.tie_word_embeddings,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
    )
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)

    def tensors() -> Iterator[tuple[str, Any]]:
        for name, dims, is_norm in _base_tensors(shape, vocab):
            if is_norm:
                yield name, torch.ones(dims, dtype=torch.bfloat16)
            else:
                t = torch.empty(dims, dtype=torch.bfloat16)
                yield name, t.normal_(0.0, _STD, generator=gen)

    _write_sharded(path, tensors(), "model")


def write_adapter(
    base: pathlib.Path,
    path: pathlib.Path,
    shape: ModelShape,
    *,
    seed: int,
    rank: int,
    targets: Sequence[str],
) -> None:
    """Saves a random PEFT LoRA adapter on the `targets` projections.

    As `tiny_model.build_lora_adapter` (A ~ N(0, 1/in_features), B ~
    N(0, 0.02), alpha = 2 * rank), but written directly.
    """
    import torch
    from peft import LoraConfig

    path.mkdir(parents=True, exist_ok=True)
    every = _projections(shape)
    projections = {t: every[t] for t in targets}
    LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(projections),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base),
    ).save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)

    def tensors() -> Iterator[tuple[str, Any]]:
        for layer in range(shape.num_layers):
            for module, fan_in, fan_out in projections.values():
                key = f"base_model.model.model.layers.{layer}.{module}"
                a = torch.randn((rank, fan_in), generator=gen) * fan_in**-0.5
                b = torch.randn((fan_out, rank), generator=gen) * _STD
                yield f"{key}.lora_A.weight", a
                yield f"{key}.lora_B.weight", b

    _write_sharded(path, tensors(), "adapter_model")


def ensure_models(
    shape: ModelShape, num_adapters: int, rank: int, targets: Sequence[str]
) -> dict[str, Any]:
    """The cached model and adapters, built if missing.

    Returns:
        ``{"base": path, "adapters": {name: path}, "built_s": seconds}``.
    """
    root = _cache_root() / (
        f"{shape.name}-{shape.num_layers}l-{num_adapters}xr{rank}"
        f"{'' if tuple(targets) == PROJECTIONS else '-' + '-'.join(targets)}"
        f"-v{_MODEL_VERSION}"
    )
    base = root / "base"
    names = [f"adapter-{i + 1}" for i in range(num_adapters)]
    done = root / "COMPLETE"
    started = time.perf_counter()
    if not done.exists():
        print(f"Building the model and adapters in {root} ...", flush=True)
        if root.exists():
            shutil.rmtree(root)
        write_base(base, shape)
        for i, name in enumerate(names):
            write_adapter(
                base,
                root / name,
                shape,
                seed=i + 1,
                rank=rank,
                targets=targets,
            )
        done.write_text("ok\n")
    else:
        print(f"Using the cached model and adapters in {root}", flush=True)
    return {
        "base": str(base),
        "adapters": {name: str(root / name) for name in names},
        "built_s": time.perf_counter() - started,
    }


# The shapes of the presets (vllm_e2e.PRESETS).
LLAMA_3_2_1B = ModelShape(
    "llama-3.2-1b",
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
LLAMA_2_7B = ModelShape(
    "llama-2-7b",
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    vocab_size=32000,
)


def llama_7b_layers(num_layers: int) -> ModelShape:
    """Llama-2-7B layers, `num_layers` of them, the demo's tiny vocabulary
    (an LM head that costs almost nothing)."""
    return dataclasses.replace(
        LLAMA_2_7B,
        name="llama7b-shapes",
        num_layers=num_layers,
        vocab_size=None,
    )
