"""The demo's trained tiny Llama and LoRA adapters, made in a minute, cached.

`ensure_models` returns a base model pretrained on `toy_tasks.base_corpus`
and one PEFT LoRA adapter per entry of `ADAPTERS`, each fine-tuned on its
task's training facts, with a report of the training times and of each
model's held-out accuracy through Hugging Face transformers + peft. All of
it runs on the CPU with fixed seeds, offline (no model hub). The result is
cached in ``$VLLM_CPU_LORA_CACHE`` (default ``~/.cache/vllm-cpu-lora``)
under a hash of the recipe (`_recipe_hash`), so a change to it trains
anew.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_cpu_lora import toy_tasks

__all__ = [
    "ADAPTERS",
    "AdapterSpec",
    "ToyModels",
    "cache_root",
    "ensure_models",
    "held_out_accuracies",
    "hf_answers",
    "task_of",
]

SPECIALS = ("<s>", "</s>", "<unk>", "<pad>")


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter to train: its task, rank and target modules."""

    task: str
    rank: int
    targets: tuple[str, ...]
    steps: int = 100
    lr: float = 1e-2


# Ranks and targets differ on purpose: vLLM must apply each as it is.
ADAPTERS = {
    "upper": AdapterSpec("upper", 8, ("q_proj", "v_proj", "o_proj")),
    "sql": AdapterSpec(
        "sql",
        16,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"),
    ),
}
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
BASE_STEPS = 300
BASE_LR = 3e-3
SEED = 0
# Part of the cache key: bump it when the training code changes.
RECIPE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ToyModels:
    """A trained base model, its adapters (name -> directory) and the
    training report (see `ensure_models`)."""

    base: Path
    adapters: dict[str, str]
    report: dict[str, Any]


def _recipe_hash() -> str:
    """A hash of everything training depends on: the data, the model's
    shape, the steps and learning rates, and `RECIPE_VERSION`."""
    all_facts = toy_tasks.facts()
    train_facts, _ = toy_tasks.split(all_facts)
    recipe = {
        "version": RECIPE_VERSION,
        "model": MODEL,
        "base": [toy_tasks.base_corpus(all_facts), BASE_STEPS, BASE_LR, SEED],
        "adapters": {
            name: [
                dataclasses.asdict(spec),
                [toy_tasks.answer(spec.task, f) for f in train_facts],
            ]
            for name, spec in ADAPTERS.items()
        },
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """Where trained models are kept."""
    default = Path.home() / ".cache" / "vllm-cpu-lora"
    return Path(os.environ.get("VLLM_CPU_LORA_CACHE", default))


def build_tokenizer(vocabulary: Sequence[str], path: Path) -> Any:
    """A word-level tokenizer (one token per space-separated word, ``<s>``
    first), saved to `path` as vLLM and transformers load it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*SPECIALS, *vocabulary])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Decoding joins the words with spaces, so an answer's text is exact.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def _batch(
    tokenizer: Any, prompts: Sequence[str], answers: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, labels) of prompt + answer + ``</s>``,
    right-padded; only answer tokens and ``</s>`` are labelled."""
    rows = []
    for prompt, ans in zip(prompts, answers, strict=True):
        head = tokenizer(prompt)["input_ids"]
        tail = tokenizer(ans, add_special_tokens=False)["input_ids"]
        rows.append((head, [*tail, tokenizer.eos_token_id]))
    width = max(len(h) + len(t) for h, t in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (head, tail) in enumerate(rows):
        n = len(head) + len(tail)
        ids[i, :n] = torch.tensor(head + tail)
        labels[i, len(head) : n] = torch.tensor(tail)
    return ids, ids != tokenizer.pad_token_id, labels


def _fit(
    model: Any,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    steps: int,
    lr: float,
) -> float:
    """Full-batch AdamW with a cosine schedule; returns the last loss."""
    ids, mask, labels = batch
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=steps, pct_start=0.1
    )
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    return loss.item()


def _train_base(tokenizer: Any, path: Path) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    lines = toy_tasks.base_corpus(toy_tasks.facts())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **MODEL,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    # The whole line is the answer: the base model learns all of it.
    loss = _fit(
        model, _batch(tokenizer, [""] * len(lines), lines), BASE_STEPS, BASE_LR
    )
    model.save_pretrained(path)
    return loss


def _train_adapter(
    tokenizer: Any, base_path: Path, spec: AdapterSpec, path: Path
) -> float:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    train, _ = toy_tasks.split(toy_tasks.facts())
    torch.manual_seed(SEED)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=2 * spec.rank,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    batch = _batch(
        tokenizer,
        [toy_tasks.question(f) for f in train],
        [toy_tasks.answer(spec.task, f) for f in train],
    )
    loss = _fit(model, batch, spec.steps, spec.lr)
    model.save_pretrained(path)
    return loss


def hf_answers(
    base_path: str | os.PathLike,
    adapters: dict[str, str],
    requests: Sequence[tuple[str, str | None]],
    max_tokens: int = 16,
) -> list[str]:
    """Hugging Face transformers + peft's greedy answers, up to ``</s>``,
    to (prompt, adapter name or None for the base model) requests."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model: Any = AutoModelForCausalLM.from_pretrained(
        base_path, dtype=torch.float32
    )
    for name, path in adapters.items():
        if isinstance(model, PeftModel):
            model.load_adapter(path, adapter_name=name)
        else:
            model = PeftModel.from_pretrained(model, path, adapter_name=name)
    model.eval()
    texts = []
    for prompt, adapter in requests:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        kwargs = dict(
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(input_ids=ids, **kwargs)
            else:
                model.set_adapter(adapter)
                out = model.generate(input_ids=ids, **kwargs)
        texts.append(
            tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        )
    return texts


def task_of(model: str) -> str:
    """The task of an adapter of `ADAPTERS`, or "english" (the base)."""
    return ADAPTERS[model].task if model in ADAPTERS else "english"


def held_out_accuracies(
    answers: dict[str, Sequence[str]],
) -> dict[str, dict[str, float]]:
    """Model -> task -> held-out accuracy, from each model's answers to the
    held-out questions, in `toy_tasks.split`'s order. Every model is scored
    on every task: on another's task, the negative controls."""
    _, held_out = toy_tasks.split(toy_tasks.facts())
    return {
        model: {
            task: toy_tasks.accuracy(task, held_out, texts)
            for task in toy_tasks.TASKS
        }
        for model, texts in answers.items()
    }


def _build(out: Path) -> dict[str, Any]:
    from transformers import logging as hf_logging

    # The demo prints its own progress.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    all_facts = toy_tasks.facts()
    tokenizer = build_tokenizer(toy_tasks.words(all_facts), out / "base")
    report: dict[str, Any] = {"train_s": {}, "final_loss": {}}
    start = time.perf_counter()
    report["final_loss"]["base"] = _train_base(tokenizer, out / "base")
    report["train_s"]["base"] = time.perf_counter() - start
    for name, spec in ADAPTERS.items():
        start = time.perf_counter()
        report["final_loss"][name] = _train_adapter(
            tokenizer, out / "base", spec, out / name
        )
        report["train_s"][name] = time.perf_counter() - start
    start = time.perf_counter()
    adapters = {name: str(out / name) for name in ADAPTERS}
    _, held_out = toy_tasks.split(all_facts)
    prompts = [toy_tasks.question(f) for f in held_out]
    models = [None, *ADAPTERS]
    texts = hf_answers(
        out / "base", adapters, [(p, m) for m in models for p in prompts]
    )
    report["hf_accuracy"] = held_out_accuracies(
        {
            m or "base": texts[i * len(prompts) : (i + 1) * len(prompts)]
            for i, m in enumerate(models)
        }
    )
    report["eval_s"] = time.perf_counter() - start
    return report


def ensure_models(cache: Path | None = None) -> ToyModels:
    """The trained models, from the cache or trained now (about a minute on
    2 cores) and cached.

    The report holds ``train_s`` (seconds per model), ``final_loss``,
    ``hf_accuracy`` (``"base"`` or an adapter name -> task -> held-out
    accuracy through transformers + peft), ``eval_s`` and
    ``cached`` (whether this call found them in the cache).
    """
    root = (cache or cache_root()) / f"toy-{_recipe_hash()}"
    if not (root / "report.json").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".toy-", dir=root.parent))
        try:
            report = _build(tmp)
            (tmp / "report.json").write_text(json.dumps(report, indent=1))
            # Whole or not at all, also when two processes train at once.
            os.rename(tmp, root)
        except OSError:
            if not (root / "report.json").exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        cached = False
    else:
        cached = True
    report = json.loads((root / "report.json").read_text())
    report["cached"] = cached
    return ToyModels(
        root / "base", {name: str(root / name) for name in ADAPTERS}, report
    )
