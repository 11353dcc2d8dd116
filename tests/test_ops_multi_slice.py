"""The multi-slice ops (`lora_shrink`, `lora_expand`: all the slices of a
layer in one call) against the float64 oracle, on every ISA path.

Same method as tests/test_ops.py, whose helpers these tests use: fresh random
operands, NaN-poisoned outputs in overwrite mode, add-mode elements no
product reaches kept bit for bit, the oracle's error bound. The slices have
odd, unequal sizes; rows without an adapter (-1) are mixed in. A fused call
must also equal the slice-by-slice calls of the per-slice ops bit for bit:
it runs the same kernels on the same grouping. Hypothesis draws further
shapes, slice counts and dtypes.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ops import (
    ALL_DTYPE_COMBOS,
    BF16,
    EXPAND_FAST_COMBOS,
    F16,
    F32,
    KERNEL_THREADS,
    NAN,
    PATTERNS,
    SHRINK_FAST_COMBOS,
    Call,
    _eager,
    _Passthrough,
    _SeenOps,
    bgmv_indices,
    check,
    check_unread_weights,
    dtypes_id,
    make_generator,
    make_output,
    make_values,
    run_kernel,
)
from test_property import PROPERTY_SETTINGS

import vllm_cpu_lora
from vllm_cpu_lora import ops

# (tokens, hidden, rank, adapters, slice rows): one token, a decode batch,
# more tokens than a work item; qkv-like (3) and gate_up-like (2) slices.
SHAPES = (
    (1, 64, 16, 3, (48, 16, 16)),
    (5, 129, 8, 4, (37, 19)),
    (40, 200, 16, 5, (96, 32, 32)),
)
# Expand: all slices start at offset_start, with spare columns both sides.
OFFSET_START, SPARE = 3, 5


def shrink_call(dtypes, shape, pattern, gen) -> Call:
    """lora_shrink: out[s, :, :rank] = scale * x @ A[s].T."""
    tokens, hidden, rank, loras, rows = shape
    x_dtype, w_dtype, out_dtype = dtypes
    x = make_values((tokens, hidden), x_dtype, gen)
    weights = [
        make_values((loras, 1, rank, hidden), w_dtype, gen) for _ in rows
    ]
    out = make_output((len(rows), tokens, rank + 2), out_dtype, gen, add=False)
    idx = bgmv_indices(tokens, loras, pattern, gen, torch.int64)
    args = [x, weights, out, idx, 0.75]
    return Call("lora_shrink", args, 2, 0, 1, 4, hidden, False)


def expand_call(dtypes, shape, pattern, add, gen) -> Call:
    """lora_expand: out[:, c(s):c(s) + rows[s]] (+)= x[s] @ B[s].T."""
    tokens, _, rank, loras, rows = shape
    x_dtype, w_dtype, out_dtype = dtypes
    x = make_values((len(rows), tokens, rank), x_dtype, gen)
    weights = [make_values((loras, 1, n, rank), w_dtype, gen) for n in rows]
    width = OFFSET_START + sum(rows) + SPARE
    out = make_output((tokens, width), out_dtype, gen, add)
    idx = bgmv_indices(tokens, loras, pattern, gen, torch.int64)
    args = [x, weights, out, idx, OFFSET_START, add]
    return Call("lora_expand", args, 2, 0, 1, None, rank, add)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", SHRINK_FAST_COMBOS, ids=dtypes_id)
def test_lora_shrink(dtypes, shape, pattern, isa):
    gen = make_generator("lora_shrink", dtypes, shape, pattern)
    check(shrink_call(dtypes, shape, pattern, gen), isa)


@pytest.mark.parametrize("add", (False, True), ids=("store", "add"))
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", EXPAND_FAST_COMBOS, ids=dtypes_id)
def test_lora_expand(dtypes, shape, pattern, add, isa):
    gen = make_generator("lora_expand", dtypes, shape, pattern, add)
    check(expand_call(dtypes, shape, pattern, add, gen), isa)


@pytest.mark.parametrize("add", (False, True), ids=("store", "add"))
@pytest.mark.parametrize("dtypes", EXPAND_FAST_COMBOS, ids=dtypes_id)
def test_lora_expand_zero_inputs(dtypes, add, isa):
    """A slice whose inputs are all zeros, as vLLM's shrink leaves them for
    adapters without that module (it zeroes their weights), and one
    adapter's zero inputs in another slice: the oracle's result, without
    reading those weights (NaN there changes nothing)."""
    gen = make_generator("lora_expand_zero_inputs", dtypes, add)
    call = expand_call(dtypes, SHAPES[-1], "mixed", add, gen)
    x, weights, idx = call.args[0], call.args[1], call.args[3]
    x[1] = 0.0
    x[0, idx == idx.max()] = -0.0

    def poison(call):
        weights[1].fill_(NAN)
        weights[0][idx.max()] = NAN

    check_unread_weights(call, isa, poison)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_slices_of_views(shape, isa):
    """Stacked outputs and inputs, and [L, 1, rows, cols] weights, that are
    views into larger buffers (a storage offset, padded strides; the
    inputs' columns strided): the ops take these apart themselves, not
    through torch's select. The oracle's result, and the buffer outside the
    output view unchanged."""
    gen = make_generator("slices of views", shape)
    dtypes = SHRINK_FAST_COMBOS[0]
    shrink = shrink_call(dtypes, shape, "mixed", gen)
    weights = shrink.args[1][-1]
    loras, _, rank, hidden = weights.shape
    padded = torch.empty((loras, 3, rank, hidden + 2), dtype=weights.dtype)
    shrink.args[1][-1] = padded[:, 1:2, :, 1:-1].copy_(weights)
    out = shrink.args[2]
    slices, tokens, width = out.shape
    buffer = make_output(
        (slices + 1, tokens + 2, width + 3), out.dtype, gen, add=False
    )
    inside = (slice(1, None), slice(1, -1), slice(2, -1))
    buffer[inside] = out
    before = buffer.clone()
    shrink.args[2] = buffer[inside]
    check(shrink, isa)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[inside] = False
    torch.testing.assert_close(
        buffer[outside], before[outside], rtol=0, atol=0, equal_nan=True
    )

    expand = expand_call(EXPAND_FAST_COMBOS[0], shape, "mixed", True, gen)
    x = expand.args[0]
    columns_strided = torch.empty(
        (slices + 1, x.size(2), tokens), dtype=x.dtype
    )[1:].transpose(1, 2)
    columns_strided.copy_(x)
    expand.args[0] = columns_strided
    check(expand, isa)


@st.composite
def drawn_shapes(draw):
    """(tokens, hidden, rank, adapters, slice rows) of any size, 1-3 slices
    (the threaded path from 64 tokens and wide hidden sizes)."""
    return (
        draw(st.integers(1, 80)),
        draw(st.integers(1, 320)),
        draw(st.integers(1, 40)),
        draw(st.integers(1, 6)),
        tuple(draw(st.lists(st.integers(1, 140), min_size=1, max_size=3))),
    )


# `isa` forces one path for the whole test, so every drawn example may share
# it.
@settings(
    PROPERTY_SETTINGS,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(
    shape=drawn_shapes(),
    dtypes=st.sampled_from(ALL_DTYPE_COMBOS),
    pattern=st.sampled_from(PATTERNS),
    add=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_drawn_calls_match_oracle(isa, shape, dtypes, pattern, add, seed):
    gen = torch.Generator().manual_seed(seed)
    check(shrink_call(dtypes, shape, pattern, gen), isa)
    check(expand_call(dtypes, shape, pattern, add, gen), isa)


# Mixed dtypes beyond the fast combinations, one shape each.
OTHER_COMBOS = ((F16, BF16, F32), (BF16, F32, F16), (F32, F16, BF16))


@pytest.mark.parametrize("dtypes", OTHER_COMBOS, ids=dtypes_id)
def test_other_dtype_combinations(dtypes, isa):
    gen = make_generator("multi-slice dtypes", dtypes)
    check(shrink_call(dtypes, SHAPES[1], "mixed", gen), isa)
    check(expand_call(dtypes, SHAPES[1], "mixed", True, gen), isa)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_calls_equal_the_per_slice_ops(shape, isa):
    # The per-slice calls run on as many threads as the fused ones, so that
    # both split the work alike.
    torch.set_num_threads(KERNEL_THREADS)
    gen = make_generator("fused vs per slice", shape)
    shrink = shrink_call(SHRINK_FAST_COMBOS[0], shape, "mixed", gen)
    x, a_weights, buffer, idx, scale = shrink.args
    per_slice = buffer.clone()
    for s, weights in enumerate(a_weights):
        ops.bgmv_shrink(x, weights, per_slice[s], idx, scale)
    torch.testing.assert_close(
        run_kernel(shrink, isa), per_slice, rtol=0, atol=0, equal_nan=True
    )

    expand = expand_call(EXPAND_FAST_COMBOS[0], shape, "mixed", True, gen)
    inputs, b_weights, out, idx, offset, add = expand.args
    per_slice = out.clone()
    for s, weights in enumerate(b_weights):
        rows = weights.size(-2)
        ops.bgmv_expand_slice(
            inputs[s], weights, per_slice, idx, offset, rows, add
        )
        offset += rows
    torch.testing.assert_close(
        run_kernel(expand, isa), per_slice, rtol=0, atol=0
    )


@pytest.mark.parametrize("op", ("lora_shrink", "lora_expand"))
def test_opcheck(op):
    """Schema (mutation annotations), fake impl and autograd registration
    pass torch.library.opcheck."""
    gen = make_generator("opcheck", op)
    if op == "lora_shrink":
        call = shrink_call(SHRINK_FAST_COMBOS[0], SHAPES[1], "mixed", gen)
    else:
        call = expand_call(EXPAND_FAST_COMBOS[0], SHAPES[1], "mixed", True, gen)
    call.args[call.out] = make_values(call.output.shape, F32, gen).to(
        call.output.dtype
    )
    overload = getattr(torch.ops.vllm_cpu_lora, op).default
    torch.library.opcheck(overload, tuple(call.args))


def _call(op: str, gen) -> Call:
    if op == "lora_shrink":
        return shrink_call(SHRINK_FAST_COMBOS[0], SHAPES[1], "mixed", gen)
    return expand_call(EXPAND_FAST_COMBOS[0], SHAPES[1], "mixed", False, gen)


@pytest.mark.parametrize("op", ("lora_shrink", "lora_expand"))
def test_eager_fast_path_runs_the_kernel(op, isa):
    """On plain CPU tensors (a Parameter among the weights, a tuple of
    weights too) the fast path runs the kernel, with the oracle's result
    and bit for bit the dispatched op's."""
    for variant in ("list", "tuple with a parameter"):
        call = _call(op, make_generator("eager", op, variant))
        if variant != "list":
            weights = call.args[call.w]
            weights[0] = torch.nn.Parameter(weights[0], False)
        check(call, isa, run=lambda c: (_eager(c) or None) and c.output)
        dispatched = dataclasses.replace(
            call, args=list(call.args), api=torch.ops.vllm_cpu_lora
        )
        dispatched.args[call.out] = torch.full_like(call.output, NAN)
        call.args[call.out] = torch.full_like(call.output, NAN)
        if variant != "list":
            call.args[call.w] = tuple(call.args[call.w])
        assert _eager(call)
        run_kernel(dispatched, isa)
        torch.testing.assert_close(
            call.output, dispatched.output, rtol=0, atol=0, equal_nan=True
        )


@pytest.mark.parametrize("op", ("lora_shrink", "lora_expand"))
def test_eager_fast_path_declines(op):
    """Wherever the dispatcher has more to do than reach the CPU kernel (in
    any slice's weights too), the fast path answers False without touching
    the output, and ops reaches the op through the dispatcher."""
    gen = make_generator("eager-declines", op)

    def declined(call: Call) -> None:
        before = call.output.clone()
        assert _eager(call) is False
        torch.testing.assert_close(
            call.output, before, rtol=0, atol=0, equal_nan=True
        )

    call = _call(op, gen)
    call.args[call.x].requires_grad_(True)
    declined(call)

    call = _call(op, gen)
    call.args[call.w][-1] = call.args[call.w][-1].as_subclass(_Passthrough)
    declined(call)

    call = _call(op, gen)
    call.args[call.w][-1] = call.args[call.w][-1].to("meta")
    declined(call)

    call = _call(op, gen)
    call.args[call.w] = iter(call.args[call.w])
    declined(call)

    call = _call(op, gen)
    with _SeenOps() as mode:
        declined(call)
        getattr(ops, op)(*call.args)
    assert getattr(torch.ops.vllm_cpu_lora, op).default in mode.seen

    with pytest.raises(TypeError, match="takes"):
        getattr(vllm_cpu_lora._C, "eager_" + op)(*call.args[:-1])
