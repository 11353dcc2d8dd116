"""LoRA in vLLM's compiled mode: the model vLLM compiles by default on CPU
(`CompilationMode.DYNAMO_TRACE_ONCE`, inductor), which vLLM itself turns
off whenever LoRA is enabled, and the plug-in turns back on.

The model is traced once, at start-up, before any adapter is loaded; every
later step reuses that graph. Each configuration runs three batches in one
vLLM child process, greedy, on a tiny random Llama with four adapters (one
on q and v only, as PEFT's default for Llama) and `max_loras=2`:

1. two adapters and none, mixed;
2. a smaller batch with a third adapter, loaded at run time;
3. all four adapters and none: more adapters than slots, so the scheduler
   swaps adapters in and out of the two slots between steps, and the batch
   size changes from step to step.

Checked:

* the compiled mode was in use: the worker reports `DYNAMO_TRACE_ONCE` and
  one graph captured by torch.compile, and the LoRA ops ran from it;
* float32: the compiled model's tokens equal the eager model's and are
  Hugging Face transformers + peft's greedy tokens, with chunked prefill
  (a token budget of 8 per step: prompts split across steps, mixed with
  decodes) and without it;
* bfloat16: every token within rounding noise of HF's argmax.

Needs a CPU build of vLLM (scripts/setup_vllm_env.sh); skipped without one.
Each compiled child takes about a minute more than an eager one to start
(dynamo and inductor on 2 cores).
"""

import pytest
from tiny_vllm import skip_module_without

skip_module_without("vllm", "transformers", "peft", "tokenizers")

import torch  # noqa: E402

from vllm_cpu_lora import offline, plugin, tiny_model  # noqa: E402

MAX_TOKENS = 10
P = tiny_model.PROMPTS
BATCHES = [
    [(P[0], "a1"), (P[0], None), (P[0], "a2"), (P[1], "a2"), (P[2], None)],
    [(P[3], "a3"), (P[4], None)],
    [
        (P[0], "a4"),
        (P[1], "a3"),
        (P[2], "a1"),
        (P[3], None),
        (P[4], "a2"),
        (P[5], "a4"),
        (P[6], None),
    ],
]
CHUNKED = {"max_num_batched_tokens": 8, "max_num_seqs": 8}
UNCHUNKED = {"enable_chunked_prefill": False}
# As tests/test_vllm_e2e.py: HF (float32)'s best logit minus the logit of
# the token vLLM chose, at most.
BF16_GAP = 0.15


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_compiled")
    base = tiny_model.build_tiny_llama(work / "tiny-llama")
    ranks = {"a1": 8, "a2": 16, "a3": 8, "a4": 16}
    # a3 adapts q and v only, PEFT's default for Llama: vLLM zeroes its
    # slots of the other modules, and the kernels skip those products.
    targets = {"a3": ("q_proj", "v_proj")}
    adapters = {
        name: str(
            tiny_model.build_lora_adapter(
                base,
                work / name,
                seed=10 + i,
                rank=rank,
                targets=targets.get(name, tiny_model.LORA_TARGETS),
            )
        )
        for i, (name, rank) in enumerate(ranks.items())
    }
    return str(base), adapters


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    """run(dtype, compiled, llm_args) -> the child's result, cached."""
    base, adapters = models
    logs = tmp_path_factory.mktemp("vllm_compiled_logs")
    cache = {}

    def _run(dtype, compiled, llm_args):
        key = (dtype, compiled, tuple(sorted(llm_args.items())))
        if key not in cache:
            spec = {
                "model": base,
                "adapters": adapters,
                "batches": BATCHES,
                "max_tokens": MAX_TOKENS,
                "dtype": dtype,
                "max_lora_rank": 16,
                "max_loras": 2,
                "llm_args": {"enforce_eager": not compiled, **llm_args},
            }
            result = offline.run_vllm_child(
                spec, log_path=logs / f"{dtype}-{compiled}-{len(cache)}"
            )
            assert result["error"] is None, (
                f"vLLM failed: {result['error']}\n{result['log'][-6000:]}"
            )
            cache[key] = result
        return cache[key]

    return _run


def _tokens(result):
    return [
        [out["token_ids"] for out in batch["outputs"]]
        for batch in result["batches"]
    ]


def _hf_logits(models, result):
    base, adapters = models
    sequences = [
        (out["prompt_token_ids"], out["token_ids"], adapter)
        for batch, requests in zip(result["batches"], BATCHES, strict=True)
        for out, (_, adapter) in zip(batch["outputs"], requests, strict=True)
    ]
    return tiny_model.hf_next_token_logits(base, adapters, sequences)


def _requests():
    return [request for batch in BATCHES for request in batch]


def test_compiled_mode_is_in_use(run):
    result = run("float32", True, CHUNKED)
    report = result["report"]
    assert report["compilation_mode"] == "DYNAMO_TRACE_ONCE"
    # Traced once: every batch size and adapter mix reused the graph.
    assert report["dynamo_graphs"] == 1
    assert report["wrappers"] == [plugin.WRAPPER]
    assert {"lora_shrink", "lora_expand"} <= set(report["calls"])
    assert "LoRA with compilation mode DYNAMO_TRACE_ONCE" in result["log"]
    eager = run("float32", False, CHUNKED)["report"]
    assert eager["compilation_mode"] == "NONE" and eager["dynamo_graphs"] == 0


@pytest.mark.parametrize(
    "llm_args", [CHUNKED, UNCHUNKED], ids=["chunked", "unchunked"]
)
def test_float32_compiled_matches_hf(models, run, llm_args):
    result = run("float32", True, llm_args)
    hf = _hf_logits(models, result)
    outputs = [o for batch in result["batches"] for o in batch["outputs"]]
    for out, logits, request in zip(outputs, hf, _requests(), strict=True):
        assert out["token_ids"] == logits.argmax(-1).tolist(), request
    # The adapters change the output (else this test would prove little).
    first = [o["token_ids"] for o in result["batches"][0]["outputs"][:3]]
    assert len({tuple(t) for t in first}) == 3


def test_float32_compiled_equals_eager(run):
    assert _tokens(run("float32", True, CHUNKED)) == _tokens(
        run("float32", False, CHUNKED)
    )


def test_bfloat16_compiled_matches_hf_within_rounding(models, run):
    result = run("bfloat16", True, UNCHUNKED)
    assert result["report"]["compilation_mode"] == "DYNAMO_TRACE_ONCE"
    hf = _hf_logits(models, result)
    outputs = [o for batch in result["batches"] for o in batch["outputs"]]
    for out, logits, request in zip(outputs, hf, _requests(), strict=True):
        chosen = logits.gather(1, torch.tensor(out["token_ids"])[:, None])
        gaps = logits.max(-1).values - chosen[:, 0]
        assert float(gaps.max()) <= BF16_GAP, (request, gaps.tolist())
