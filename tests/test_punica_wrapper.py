"""`PunicaWrapperCPULoRA` against vLLM's own `PunicaWrapperCPU`.

Both wrappers get the same LoRA mapping (prefill and decode, mixed adapters
and rows without one) and the same tensors, in vLLM's dtypes (bf16
activations and weights, fp32 intermediate buffer) and in fp32, for every
entry point vLLM's LoRA layers use: linear (sliced, as for q/k/v), shrink and
expand alone (row-parallel), embedding, logits and full-linear heads.
Outputs must agree within vLLM's own op-test tolerances, and the call
counters must show that our ops ran.

vLLM before 0.33 gets one thing wrong that 0.33 fixed: its torch ops'
expand gathers `weights[index]` with index -1 for rows without an adapter,
so those rows get the last slot's adapter added. On such a vLLM its wrapper
runs here on `vllm_cpu_lora.reference` (vLLM 0.33's algorithm), and
`test_vllm_before_0_33_adds_an_adapter_to_rows_without_one` shows the bug
itself. Needs a CPU build of vLLM
(scripts/setup_vllm_env.sh); skipped without one.
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "needs vLLM (a CPU build: scripts/setup_vllm_env.sh)",
        allow_module_level=True,
    )

import torch._dynamo.testing  # noqa: E402
import vllm  # noqa: E402
from oracle import VLLM_OPS  # noqa: E402
from vllm.lora.layers import LoRAMapping  # noqa: E402
from vllm.lora.ops import torch_ops  # noqa: E402
from vllm.lora.punica_wrapper import punica_cpu  # noqa: E402
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402

from vllm_cpu_lora import punica, reference, vllm_compat  # noqa: E402

VLLM_MISAPPLIES_NO_LORA = vllm_compat.torch_ops_misapply_no_lora(
    vllm.__version__
)

MAX_LORAS = 4
# Slot -> LoRA id; slot 2 is empty.
LORA_INDEX_TO_ID = [1, 2, None, 3]
VOCAB = 300
HIDDEN = 200
RANK = 16
SLICES = (128, 64, 64)
# Requests: (tokens in this step, LoRA id; 0 means none).
REQUESTS = [(3, 1), (5, 0), (1, 3), (4, 2), (2, 1)]
# vLLM's op tests: fp16/bf16 6e-2, fp32 1e-2; fp32 here agrees far better.
TOLERANCES = {
    torch.bfloat16: {"atol": 6e-2, "rtol": 6e-2},
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
}


def _mapping(is_prefill: bool, requests=REQUESTS) -> LoRAMapping:
    if is_prefill:
        index = [lora for n, lora in requests for _ in range(n)]
    else:
        index = [lora for _, lora in requests]
    prompt = [lora for _, lora in requests]
    return LoRAMapping(index, prompt, is_prefill=is_prefill)


def _wrappers(is_prefill: bool, requests=REQUESTS):
    mapping = _mapping(is_prefill, requests)
    pair = []
    for cls in (PunicaWrapperCPU, punica.PunicaWrapperCPULoRA):
        wrapper = cls(64, 16, "cpu")
        wrapper.update_metadata(mapping, LORA_INDEX_TO_ID, MAX_LORAS, VOCAB)
        pair.append(wrapper)
    return pair, len(mapping.index_mapping), len(requests)


def _rand(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _slice_weights(dtype):
    """(lora_a, lora_b): one stacked A and B per slice of SLICES."""
    lora_a = tuple(
        _rand(MAX_LORAS, 1, RANK, HIDDEN, dtype=dtype, scale=0.1, seed=2 + i)
        for i in range(len(SLICES))
    )
    lora_b = tuple(
        _rand(MAX_LORAS, 1, n, RANK, dtype=dtype, scale=0.1, seed=9 + i)
        for i, n in enumerate(SLICES)
    )
    return lora_a, lora_b


def _check(ours, theirs, dtype):
    torch.testing.assert_close(ours, theirs, **TOLERANCES[dtype])


@pytest.fixture(autouse=True)
def _vllm_wrapper_on_correct_ops(monkeypatch):
    """vLLM's wrapper on vLLM 0.33's algorithm where its ops lack the fix
    (see module doc)."""
    if VLLM_MISAPPLIES_NO_LORA:
        for name in VLLM_OPS:
            monkeypatch.setattr(punica_cpu, name, getattr(reference, name))


@pytest.fixture(autouse=True)
def _fresh_counts():
    punica.reset_call_counts()
    yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_prefill", [True, False], ids=["prefill", "decode"])
def test_add_lora_linear(dtype, is_prefill):
    (theirs, ours), tokens, _ = _wrappers(is_prefill)
    x = _rand(tokens, HIDDEN, dtype=dtype, seed=1)
    lora_a, lora_b = _slice_weights(dtype)
    y0 = _rand(tokens, sum(SLICES), dtype=dtype, seed=20)
    y_theirs, y_ours = y0.clone(), y0.clone()
    theirs.add_lora_linear(y_theirs, x, lora_a, lora_b, 0.5, SLICES)
    ours.add_lora_linear(y_ours, x, lora_a, lora_b, 0.5, SLICES)
    _check(y_ours, y_theirs, dtype)
    # Rows without an adapter are untouched.
    rows = torch.tensor(_mapping(is_prefill).index_mapping) == 0
    assert torch.equal(y_ours[rows], y0[rows])
    # All slices in one shrink and one expand call.
    assert punica.call_counts() == {"lora_shrink": 1, "lora_expand": 1}


@pytest.mark.parametrize("is_prefill", [True, False], ids=["prefill", "decode"])
def test_add_shrink_and_expand(is_prefill):
    # The row-parallel path: shrink into a caller's fp32 buffer, then expand
    # with an offset.
    dtype = torch.bfloat16
    (theirs, ours), tokens, _ = _wrappers(is_prefill)
    x = _rand(tokens, HIDDEN, dtype=dtype, seed=1)
    lora_a = (_rand(MAX_LORAS, 1, RANK, HIDDEN, dtype=dtype, scale=0.1),)
    lora_b = (_rand(MAX_LORAS, 1, 96, RANK, dtype=dtype, scale=0.1, seed=3),)
    outs = []
    for wrapper in (theirs, ours):
        buffer = torch.zeros(1, tokens, RANK, dtype=torch.float32)
        wrapper.add_shrink(buffer, x, lora_a, 2.0)
        y = torch.ones(tokens, 128, dtype=dtype)
        wrapper.add_expand(y, buffer, lora_b, (96,), offset_start=16)
        outs.append((buffer, y))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-2, rtol=1e-2)
    _check(outs[1][1], outs[0][1], dtype)
    assert punica.call_counts() == {"lora_shrink": 1, "lora_expand": 1}


@pytest.mark.parametrize("is_prefill", [True, False], ids=["prefill", "decode"])
def test_add_lora_embedding(is_prefill):
    dtype = torch.bfloat16
    (theirs, ours), tokens, _ = _wrappers(is_prefill)
    x = _rand(tokens, RANK, dtype=dtype, seed=4)
    lora_b = _rand(MAX_LORAS, 1, HIDDEN, RANK, dtype=dtype, scale=0.1, seed=5)
    y0 = _rand(tokens, HIDDEN, dtype=dtype, seed=6)
    y_theirs, y_ours = y0.clone(), y0.clone()
    theirs.add_lora_embedding(y_theirs, x, lora_b, add_inputs=True)
    ours.add_lora_embedding(y_ours, x, lora_b, add_inputs=True)
    _check(y_ours, y_theirs, dtype)
    assert punica.call_counts() == {"bgmv_expand": 1}


@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_prefill", [True, False], ids=["prefill", "decode"])
def test_add_lora_logits(is_prefill, logits_dtype):
    dtype = torch.bfloat16
    (theirs, ours), _, rows = _wrappers(is_prefill)
    x = _rand(rows, HIDDEN, dtype=dtype, seed=7)
    lora_a = _rand(MAX_LORAS, 1, RANK, HIDDEN, dtype=dtype, scale=0.1, seed=8)
    lora_b = _rand(MAX_LORAS, 1, VOCAB, RANK, dtype=dtype, scale=0.1, seed=9)
    y0 = _rand(rows, VOCAB, dtype=logits_dtype, seed=10)
    y_theirs, y_ours = y0.clone(), y0.clone()
    theirs.add_lora_logits(y_theirs, x, lora_a, lora_b, 1.0)
    ours.add_lora_logits(y_ours, x, lora_a, lora_b, 1.0)
    _check(y_ours, y_theirs, dtype)
    assert punica.call_counts() == {"bgmv_shrink": 1, "bgmv_expand": 1}


def test_apply_lora_full_linear():
    dtype = torch.bfloat16
    (theirs, ours), _, rows = _wrappers(is_prefill=True)
    labels = 24
    x = _rand(rows, HIDDEN, dtype=dtype, seed=11)
    weight = _rand(MAX_LORAS, 1, labels, HIDDEN, dtype=dtype, scale=0.1)
    bias = _rand(MAX_LORAS, labels, dtype=dtype, seed=12)
    enabled = torch.tensor([True, False, True, True])
    y0 = _rand(rows, labels, dtype=dtype, seed=13)
    y_theirs, y_ours = y0.clone(), y0.clone()
    theirs.apply_lora_full_linear(y_theirs, x, weight, bias, enabled)
    ours.apply_lora_full_linear(y_ours, x, weight, bias, enabled)
    _check(y_ours, y_theirs, dtype)
    assert punica.call_counts() == {"bgmv_shrink": 1}


def test_batch_without_any_lora_leaves_outputs_alone():
    requests = [(3, 0), (2, 0)]
    (theirs, ours), tokens, _ = _wrappers(True, requests)
    dtype = torch.bfloat16
    x = _rand(tokens, HIDDEN, dtype=dtype)
    lora_a = (_rand(MAX_LORAS, 1, RANK, HIDDEN, dtype=dtype),)
    lora_b = (_rand(MAX_LORAS, 1, 64, RANK, dtype=dtype),)
    y0 = _rand(tokens, 64, dtype=dtype, seed=3)
    y_theirs, y_ours = y0.clone(), y0.clone()
    theirs.add_lora_linear(y_theirs, x, lora_a, lora_b, 1.0, (64,))
    ours.add_lora_linear(y_ours, x, lora_a, lora_b, 1.0, (64,))
    assert torch.equal(y_ours, y0) and torch.equal(y_theirs, y0)


def test_tuple_buffers_as_vllms_signature_allows():
    # add_shrink may get one buffer per slice, add_expand a tuple of inputs.
    dtype = torch.float32
    (theirs, ours), tokens, _ = _wrappers(is_prefill=False)
    x = _rand(tokens, HIDDEN, dtype=dtype, seed=1)
    lora_a, lora_b = _slice_weights(dtype)
    outs = []
    for wrapper in (theirs, ours):
        buffers = tuple(torch.zeros(tokens, RANK) for _ in SLICES)
        wrapper.add_shrink(buffers, x, lora_a, 0.5)
        y = _rand(tokens, sum(SLICES), dtype=dtype, seed=20)
        wrapper.add_expand(y, buffers, lora_b, SLICES)
        outs.append((torch.stack(buffers), y))
    _check(outs[1][0], outs[0][0], dtype)
    _check(outs[1][1], outs[0][1], dtype)


def test_output_slices_must_match_the_weights():
    (_, ours), tokens, _ = _wrappers(is_prefill=False)
    lora_b = (_rand(MAX_LORAS, 1, 64, RANK, dtype=torch.float32),)
    with pytest.raises(ValueError, match="output_slices"):
        ours.add_expand(
            torch.zeros(tokens, 96), torch.zeros(1, tokens, RANK), lora_b, (96,)
        )


def test_rows_past_the_mapping_get_no_lora():
    # Padded inputs: rows beyond the mapping's tokens are left alone.
    (_, ours), tokens, _ = _wrappers(is_prefill=True)
    assert bool((ours._token_lora_indices[tokens:] == -1).all())
    dtype = torch.float32
    x = _rand(tokens + 3, HIDDEN, dtype=dtype, seed=1)
    lora_a = (_rand(MAX_LORAS, 1, RANK, HIDDEN, dtype=dtype, seed=2),)
    lora_b = (_rand(MAX_LORAS, 1, 64, RANK, dtype=dtype, seed=3),)
    y0 = _rand(tokens + 3, 64, dtype=dtype, seed=4)
    y = y0.clone()
    ours.add_lora_linear(y, x, lora_a, lora_b, 1.0, (64,))
    assert torch.equal(y[tokens:], y0[tokens:])
    assert not torch.equal(y[:tokens], y0[:tokens])


def test_traced_once_stays_right_for_later_batches():
    """What vLLM's compiled mode needs: one trace of a LoRA layer serves
    later batches (other token counts, adapters, prefill or decode) without
    a recompile, since nothing per batch is read outside tensors; each
    result equals vLLM's eager wrapper's."""
    dtype = torch.float32
    lora_a, lora_b = _slice_weights(dtype)
    ours = punica.PunicaWrapperCPULoRA(64, 16, "cpu")

    def layer(y, x):
        ours.add_lora_linear(y, x, lora_a, lora_b, 0.5, SLICES)
        return y

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        layer, backend=counter, fullgraph=True, dynamic=True
    )
    steps = [
        (True, REQUESTS),
        (False, REQUESTS),
        (True, [(2, 0), (6, 3)]),
        (False, [(1, 0)] * 3),
        (True, [(4, 2), (3, 2), (5, 1)]),
    ]
    for seed, (is_prefill, requests) in enumerate(steps):
        mapping = _mapping(is_prefill, requests)
        ours.update_metadata(mapping, LORA_INDEX_TO_ID, MAX_LORAS, VOCAB)
        theirs = PunicaWrapperCPU(64, 16, "cpu")
        theirs.update_metadata(mapping, LORA_INDEX_TO_ID, MAX_LORAS, VOCAB)
        tokens = len(mapping.index_mapping)
        x = _rand(tokens, HIDDEN, dtype=dtype, seed=100 + seed)
        y0 = _rand(tokens, sum(SLICES), dtype=dtype, seed=200 + seed)
        want = y0.clone()
        theirs.add_lora_linear(want, x, lora_a, lora_b, 0.5, SLICES)
        _check(compiled(y0.clone(), x), want, dtype)
    assert counter.frame_count == 1


def test_worker_lora_report_without_a_worker():
    report = punica.worker_lora_report(None)
    assert report["wrappers"] == [] and report["calls"] == {}
    assert report["compilation_mode"] is None


def test_worker_lora_report_lists_dynamo_compiles_and_their_reasons():
    @torch.compile(dynamic=True, backend="eager")
    def report_probe(x):
        return x * (x > 0)

    report_probe(torch.randn(3))
    report_probe(torch.randn(1))  # torch specializes one element: a recompile
    reasons = [
        reason
        for name, reason in punica.worker_lora_report(None)["dynamo_compiles"]
        if name == "report_probe"
    ]
    assert len(reasons) == 2 and reasons[0] is None, reasons
    assert "size()[0]" in reasons[1], reasons


def test_vllm_before_0_33_adds_an_adapter_to_rows_without_one():
    x = _rand(3, RANK, dtype=torch.float32)
    lora_b = _rand(MAX_LORAS, 8, RANK, dtype=torch.float32, seed=1)
    indices = torch.tensor([0, -1, 3])
    y0 = _rand(3, 8, dtype=torch.float32, seed=2)
    theirs, ours = y0.clone(), y0.clone()
    torch_ops.bgmv_expand(x, lora_b, theirs, indices, add_inputs=True)
    reference.bgmv_expand(x, lora_b, ours, indices, add_inputs=True)
    assert torch.equal(ours[1], y0[1])
    misapplied = y0[1] + x[1] @ lora_b[-1].T
    if VLLM_MISAPPLIES_NO_LORA:
        torch.testing.assert_close(theirs[1], misapplied)
    else:
        assert torch.equal(theirs[1], y0[1])
    torch.testing.assert_close(theirs[[0, 2]], ours[[0, 2]])
