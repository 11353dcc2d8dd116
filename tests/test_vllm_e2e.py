"""End to end: CPU vLLM with our plug-in serves LoRA as transformers + peft.

Everything is built here, offline: a tiny random-weight Llama with its own
byte-level BPE tokenizer, and random PEFT LoRA adapters (non-zero A and B on
q, k, v, o, gate, up and down; ranks 8 and 16 under max_lora_rank 16, so one
is padded). One batch mixes prompts with adapter 1, adapter 2 and none, and
vLLM decodes greedily in a child process per configuration (the plug-in
decides per process; vLLM's engine spawns processes of its own).

Checked:

* float32: vLLM's tokens are Hugging Face transformers + peft's greedy tokens
  exactly (each is the argmax of HF's logits given the tokens before it,
  which is greedy decoding without the loop);
* bfloat16 (vLLM's default: bf16 activations and LoRA weights, fp32 LoRA
  buffer): each token is within rounding noise of HF's argmax;
* the plug-in really routed the calls: the worker's LoRA wrapper is
  `PunicaWrapperCPULoRA` and its op counters show shrink and expand calls;
* `VLLM_CPU_LORA_DISABLE=1` gives vLLM's own `PunicaWrapperCPU`, no calls of
  ours, and the same tokens;
* an adapter above max_lora_rank, and a missing adapter path, fail with
  vLLM's own errors, with and without the plug-in (vLLM 0.33 reports them
  from the worker and stops the engine: the caller gets EngineDeadError).

Needs a CPU build of vLLM (scripts/setup_vllm_env.sh), this package
installed in the same environment (so vLLM finds the entry point), and
transformers, peft and tokenizers; skipped when vLLM is missing. Takes a few
minutes: each vLLM child process starts an engine (about 30 s).
"""

import importlib.metadata
import importlib.util

import pytest
from tiny_vllm import skip_module_without

skip_module_without("vllm", "transformers", "peft", "tokenizers")

import torch  # noqa: E402
import vllm  # noqa: E402
from tiny_vllm import (  # noqa: E402
    REQUESTS,
    ROUTED_OPS,
    P,
    assert_hf_greedy,
    build_models,
    hf_logits,
    outputs,
    spec,
)

from vllm_cpu_lora import offline, plugin, tiny_model, vllm_compat  # noqa: E402

VLLM_WRAPPER = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"
# bf16: largest allowed gap between HF's (float32) best logit and the logit
# of the token vLLM chose. The tiny model's logits lie within about +-4 and
# bf16 moves them by up to 0.05 (HF in bf16 against HF in float32); a wrong
# or missing LoRA delta moves them far more (see the check at the end of the
# bf16 test).
BF16_GAP = 0.15


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("vllm_e2e"))


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    """run(dtype, disable=False, adapters=..., requests=...) -> child result,
    cached per arguments."""
    cache = {}
    logs = tmp_path_factory.mktemp("vllm_logs")

    def _run(
        dtype,
        disable=False,
        adapters=("adapter-1", "adapter-2"),
        requests=REQUESTS,
    ):
        key = (dtype, disable, adapters, requests)
        if key not in cache:
            log = logs / f"{dtype}-{'off' if disable else 'on'}-{len(cache)}"
            cache[key] = offline.run_vllm_child(
                spec(models, dtype, adapters, requests),
                disable_plugin=disable,
                log_path=log,
            )
        return cache[key]

    return _run


def test_plugin_entry_point_is_installed():
    names = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
    }
    assert names.get("vllm_cpu_lora") == "vllm_cpu_lora.plugin:register", (
        "vLLM cannot find the plug-in: install this package in vLLM's "
        "environment (pip install --no-build-isolation -e .)"
    )


def test_float32_matches_hf_and_routes_through_plugin(models, run):
    result = run("float32")
    report = result["report"]
    assert report["wrappers"] == [plugin.WRAPPER]
    assert ROUTED_OPS <= set(report["calls"]), report["calls"]
    assert "vllm_cpu_lora: LoRA on CPU uses" in result["log"]
    assert_hf_greedy(models, outputs(result))


# vLLM before 0.33 adds an adapter to the rows without one in its own ops
# (vllm_compat.torch_ops_misapply_no_lora), so its fallback gets the
# no-adapter requests of a mixed batch wrong: there only the requests with
# an adapter are compared, and the others must show the bug.
FALLBACK_CORRECT = [
    adapter is not None
    or not vllm_compat.torch_ops_misapply_no_lora(vllm.__version__)
    for _, adapter in REQUESTS
]


def test_float32_disabled_falls_back_to_vllm(run):
    ours = outputs(run("float32"))
    result = run("float32", disable=True)
    theirs = outputs(result)
    assert result["report"]["wrappers"] == [VLLM_WRAPPER]
    assert result["report"]["calls"] == {}
    assert "VLLM_CPU_LORA_DISABLE is set" in result["log"]
    same = [
        a["token_ids"] == b["token_ids"]
        for a, b in zip(theirs, ours, strict=True)
    ]
    for ok, correct, request in zip(
        same, FALLBACK_CORRECT, REQUESTS, strict=True
    ):
        assert ok or not correct, request
    assert all(same) == all(FALLBACK_CORRECT)


def _gaps(logits, token_ids):
    """HF's best logit minus the logit of each chosen token (0: argmax)."""
    chosen = logits.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    return logits.max(-1).values - chosen


def test_bfloat16_matches_hf_within_rounding(models, run):
    result = run("bfloat16")
    outs = outputs(result)
    assert result["report"]["wrappers"] == [plugin.WRAPPER]
    assert ROUTED_OPS <= set(result["report"]["calls"])
    hf = hf_logits(models, outs)
    for out, logits, request in zip(outs, hf, REQUESTS, strict=True):
        gaps = _gaps(logits, out["token_ids"])
        assert float(gaps.max()) <= BF16_GAP, (request, gaps.tolist())

    # The check tells adapters apart: adapter 1's tokens, scored without it
    # or with adapter 2, are far from greedy.
    adapters = {name: models[name] for name in ("adapter-1", "adapter-2")}
    out = outs[0]
    wrong = tiny_model.hf_next_token_logits(
        models["base"],
        adapters,
        [
            (out["prompt_token_ids"], out["token_ids"], None),
            (out["prompt_token_ids"], out["token_ids"], "adapter-2"),
        ],
    )
    for logits in wrong:
        assert float(_gaps(logits, out["token_ids"]).max()) > 3 * BF16_GAP


def test_bfloat16_disabled_falls_back_to_vllm(models, run):
    result = run("bfloat16", disable=True)
    outs = outputs(result)
    assert result["report"]["wrappers"] == [VLLM_WRAPPER]
    assert result["report"]["calls"] == {}
    hf = hf_logits(models, outs)
    for out, logits, request, correct in zip(
        outs, hf, REQUESTS, FALLBACK_CORRECT, strict=True
    ):
        if correct:
            gaps = _gaps(logits, out["token_ids"])
            assert float(gaps.max()) <= BF16_GAP, (request, gaps.tolist())


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        ("rank-32", "LoRA rank 32 is greater than max_lora_rank 16"),
        ("missing", "Loading lora missing failed: No adapter found for"),
    ],
)
def test_bad_adapter_gets_vllms_error(run, adapter, message):
    requests = ((P[0], adapter),)
    errors = []
    for disable in (False, True):
        result = run("bfloat16", disable, (adapter,), requests)
        assert result["error"] is not None, f"{adapter} was accepted"
        errors.append(result["error"])
        assert message in result["error"] + result["log"]
    # The same error whether or not the plug-in is on.
    assert errors[0] == errors[1]
