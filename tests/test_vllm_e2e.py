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
import subprocess
import sys

import pytest

_NEEDED = ("vllm", "transformers", "peft", "tokenizers")
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    pytest.skip(
        f"needs {', '.join(_missing)}: a CPU build of vLLM comes from "
        "scripts/setup_vllm_env.sh, the rest from `pip install .[e2e]`",
        allow_module_level=True,
    )

import torch  # noqa: E402
import vllm  # noqa: E402

from vllm_cpu_lora import offline, plugin, tiny_model, vllm_compat  # noqa: E402

VLLM_WRAPPER = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"
MAX_TOKENS = 12
P = tiny_model.PROMPTS
# The first prompt goes with each adapter and none, so the adapters must
# visibly change the output.
REQUESTS = [
    (P[0], "adapter-1"),
    (P[0], None),
    (P[0], "adapter-2"),
    (P[1], "adapter-2"),
    (P[2], None),
    (P[3], "adapter-1"),
    (P[4], "adapter-1"),
    (P[5], "adapter-2"),
    (P[6], None),
]
# Linear layers run the multi-slice ops, one shrink and one expand call per
# layer (the bgmv ops serve embeddings, logits and full-linear heads:
# tests/test_punica_wrapper).
ROUTED_OPS = {"lora_shrink", "lora_expand"}
# bf16: largest allowed gap between HF's (float32) best logit and the logit
# of the token vLLM chose. The tiny model's logits lie within about +-4 and
# bf16 moves them by up to 0.05 (HF in bf16 against HF in float32); a wrong
# or missing LoRA delta moves them far more (see the check at the end of the
# bf16 test).
BF16_GAP = 0.15


def _is_cpu_vllm() -> bool:
    probe = (
        "from vllm.platforms import current_platform as p; "
        "import sys; sys.exit(0 if p.is_cpu() else 3)"
    )
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not _is_cpu_vllm():
        pytest.skip("vLLM is installed but is not a CPU build")
    work = tmp_path_factory.mktemp("vllm_e2e")
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
        requests=tuple(REQUESTS),
    ):
        key = (dtype, disable, adapters, requests)
        if key not in cache:
            spec = {
                "model": models["base"],
                "adapters": {name: models[name] for name in adapters},
                "batches": [list(requests)],
                "max_tokens": MAX_TOKENS,
                "dtype": dtype,
                "max_lora_rank": 16,
                "max_loras": 2,
            }
            log = logs / f"{dtype}-{'off' if disable else 'on'}-{len(cache)}"
            cache[key] = offline.run_vllm_child(
                spec, disable_plugin=disable, log_path=log
            )
        return cache[key]

    return _run


def _outputs(result):
    assert result["error"] is None, (
        f"vLLM failed: {result['error']}\n{result['log'][-6000:]}"
    )
    return result["batches"][0]["outputs"]


def _hf_logits(models, outputs):
    adapters = {name: models[name] for name in ("adapter-1", "adapter-2")}
    sequences = [
        (out["prompt_token_ids"], out["token_ids"], adapter)
        for out, (_, adapter) in zip(outputs, REQUESTS, strict=True)
    ]
    return tiny_model.hf_next_token_logits(models["base"], adapters, sequences)


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
    outputs = _outputs(result)

    report = result["report"]
    assert report["wrappers"] == [plugin.WRAPPER]
    assert ROUTED_OPS <= set(report["calls"]), report["calls"]
    assert "vllm_cpu_lora: LoRA on CPU uses" in result["log"]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["base"])
    for out, (prompt, _) in zip(outputs, REQUESTS, strict=True):
        assert out["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
        assert len(out["token_ids"]) == MAX_TOKENS

    hf = _hf_logits(models, outputs)
    for out, logits, request in zip(outputs, hf, REQUESTS, strict=True):
        assert out["token_ids"] == logits.argmax(-1).tolist(), request

    # The adapters change the output (else this test would prove little).
    with_a1, base, with_a2 = (o["token_ids"] for o in outputs[:3])
    assert with_a1 != base and with_a2 != base and with_a1 != with_a2


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
    ours = _outputs(run("float32"))
    result = run("float32", disable=True)
    theirs = _outputs(result)
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
    outputs = _outputs(result)
    assert result["report"]["wrappers"] == [plugin.WRAPPER]
    assert ROUTED_OPS <= set(result["report"]["calls"])
    hf = _hf_logits(models, outputs)
    for out, logits, request in zip(outputs, hf, REQUESTS, strict=True):
        gaps = _gaps(logits, out["token_ids"])
        assert float(gaps.max()) <= BF16_GAP, (request, gaps.tolist())

    # The check tells adapters apart: adapter 1's tokens, scored without it
    # or with adapter 2, are far from greedy.
    adapters = {name: models[name] for name in ("adapter-1", "adapter-2")}
    out = outputs[0]
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
    outputs = _outputs(result)
    assert result["report"]["wrappers"] == [VLLM_WRAPPER]
    assert result["report"]["calls"] == {}
    hf = _hf_logits(models, outputs)
    for out, logits, request, correct in zip(
        outputs, hf, REQUESTS, FALLBACK_CORRECT, strict=True
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
