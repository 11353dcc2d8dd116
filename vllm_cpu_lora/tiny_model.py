"""A tiny local Llama, random LoRA adapters and Hugging Face's reference.

Everything is made locally and offline, no model hub: a random-weight Llama
(transformers), its byte-level BPE tokenizer (trained with `tokenizers` on a
few sentences) and random PEFT LoRA adapters with non-zero A and B on all of
q, k, v, o, gate, up and down. The demo serves them; the vLLM tests check
vLLM's tokens against `hf_next_token_logits`.
"""

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "LORA_TARGETS",
    "MAX_POSITIONS",
    "PROMPTS",
    "build_lora_adapter",
    "build_tiny_llama",
    "hf_next_token_logits",
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

# The tiny Llama's context length.
MAX_POSITIONS = 512

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
        max_position_embeddings=MAX_POSITIONS,
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
