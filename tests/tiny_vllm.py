"""What the offline vLLM tests on the tiny model share.

The tiny random-weight Llama and its adapters (`vllm_cpu_lora.tiny_model`),
one mixed batch of requests, and the check of vLLM's float32 tokens against
Hugging Face transformers + peft's greedy tokens. Importing this module
needs neither vLLM nor transformers; its functions do.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_lora import tiny_model

MAX_TOKENS = 12
P = tiny_model.PROMPTS
# The first prompt goes with each adapter and none, so the adapters must
# visibly change the output.
REQUESTS = (
    (P[0], "adapter-1"),
    (P[0], None),
    (P[0], "adapter-2"),
    (P[1], "adapter-2"),
    (P[2], None),
    (P[3], "adapter-1"),
    (P[4], "adapter-1"),
    (P[5], "adapter-2"),
    (P[6], None),
)
# Linear layers run the multi-slice ops, one shrink and one expand call per
# layer (the bgmv ops serve embeddings, logits and full-linear heads:
# tests/test_punica_wrapper).
ROUTED_OPS = {"lora_shrink", "lora_expand"}
MAX_LORA_RANK = 16


def skip_module_without(*modules: str) -> None:
    """Skips the calling test module unless every one of `modules` can be
    imported (CPU vLLM and the reference's libraries: not in .venv)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"needs {', '.join(missing)}: scripts/test_vllm.sh sets them up",
            allow_module_level=True,
        )


def _is_cpu_vllm() -> bool:
    probe = (
        "from vllm.platforms import current_platform as p; "
        "import sys; sys.exit(0 if p.is_cpu() else 3)"
    )
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


def build_models(work: Path) -> dict[str, str]:
    """Builds the tiny model and adapters in `work` (skips without CPU vLLM).

    Returns:
        "base" and adapter names -> paths: "adapter-1" (rank 8, padded under
        `MAX_LORA_RANK`), "adapter-2" (rank 16), "rank-32" (above the
        limit) and "missing" (no such directory).
    """
    if not _is_cpu_vllm():
        pytest.skip("vLLM is installed but is not a CPU build")
    base = tiny_model.build_tiny_llama(work / "tiny-llama")
    return {
        "base": str(base),
        "adapter-1": str(
            tiny_model.build_lora_adapter(base, work / "lora-1", seed=1, rank=8)
        ),
        "adapter-2": str(
            tiny_model.build_lora_adapter(
                base, work / "lora-2", seed=2, rank=16, alpha=24
            )
        ),
        "rank-32": str(
            tiny_model.build_lora_adapter(
                base, work / "lora-32", seed=3, rank=32
            )
        ),
        "missing": str(work / "no-such-adapter"),
    }


def spec(
    models: dict[str, str],
    dtype: str,
    adapters: tuple[str, ...] = ("adapter-1", "adapter-2"),
    requests: tuple[tuple[str, str | None], ...] = REQUESTS,
    **engine: Any,
) -> dict[str, Any]:
    """The `vllm_cpu_lora.offline` spec of one batch of `requests`.

    Args:
        models: `build_models`' result.
        dtype: vLLM's dtype.
        adapters: The adapters the engine knows, by name in `models`.
        requests: (prompt, adapter name or None) pairs.
        **engine: Further spec keys (tensor_parallel_size, env, ...).
    """
    return {
        "model": models["base"],
        "adapters": {name: models[name] for name in adapters},
        "batches": [list(requests)],
        "max_tokens": MAX_TOKENS,
        "dtype": dtype,
        "max_lora_rank": MAX_LORA_RANK,
        "max_loras": 2,
        **engine,
    }


def outputs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The outputs of a child's only batch; fails on a vLLM error."""
    assert result["error"] is None, (
        f"vLLM failed: {result['error']}\n{result['log'][-6000:]}"
    )
    return result["batches"][0]["outputs"]


def hf_logits(models: dict[str, str], outs: list[dict[str, Any]]) -> list:
    """HF's next-token logits along each of `REQUESTS`' vLLM outputs."""
    adapters = {name: models[name] for name in ("adapter-1", "adapter-2")}
    sequences = [
        (out["prompt_token_ids"], out["token_ids"], adapter)
        for out, (_, adapter) in zip(outs, REQUESTS, strict=True)
    ]
    return tiny_model.hf_next_token_logits(models["base"], adapters, sequences)


def assert_hf_greedy(models: dict[str, str], outs: list[dict[str, Any]]):
    """Checks float32 outputs of `REQUESTS` against HF + peft, exactly.

    Each prompt is HF's tokenization, each completion has `MAX_TOKENS`
    tokens and is HF's greedy completion, and the adapters change it.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["base"])
    for out, (prompt, _) in zip(outs, REQUESTS, strict=True):
        assert out["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
        assert len(out["token_ids"]) == MAX_TOKENS

    hf = hf_logits(models, outs)
    for out, logits, request in zip(outs, hf, REQUESTS, strict=True):
        assert out["token_ids"] == logits.argmax(-1).tolist(), request

    # The adapters change the output (else the check would prove little).
    with_a1, base, with_a2 = (o["token_ids"] for o in outs[:3])
    assert with_a1 != base and with_a2 != base and with_a1 != with_a2
