"""Property tests: every op against the float64 oracle on drawn cases.

Hypothesis draws the structure of a call (op-specific shapes, ranks, adapter
counts, the three operand dtypes, index pattern and dtype, sgmv segments,
slices, add or overwrite mode, weight layout, strided views); the operand
values come from a torch generator seeded by a drawn integer, so a failure
prints a `Spec` that rebuilds the exact call. Each op runs once per ISA path
this CPU supports (forced through VLLM_CPU_LORA_ISA) and once with the
variable unset (the per-call automatic choice, e.g. AMX only for large
groups).

Every call is checked with `oracle.assert_close_to_oracle` (overwrite-mode
outputs are poisoned with NaN, so elements that must stay untouched are
checked too); in add mode untouched elements must keep their bits; memory
around the output view and every input tensor must be unchanged.

The runs are reproducible: `derandomize=True` and no example database.
"""

import contextlib
import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from oracle import (
    ALL_OPS,
    DISPATCH_OPS,
    EXPAND_OPS,
    MULTI_SLICE_OPS,
    SHRINK_OPS,
    assert_close_to_oracle,
    f64,
    run_oracle,
)

import vllm_cpu_lora
from vllm_cpu_lora import ops

ISA_ENV = "VLLM_CPU_LORA_ISA"
# No VLLM_CPU_LORA_ISA: the kernels choose per call.
DEFAULT_ISA = "default"
ISA_PARAMS = (*vllm_cpu_lora.supported_isas(), DEFAULT_ISA)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = (F32, BF16, F16)
I32, I64 = torch.int32, torch.int64


# Index patterns of the bgmv and dispatch ops.
PATTERNS = ("none", "same", "distinct", "runs", "random")
# x: contiguous, a column slice of a wider buffer (row stride > columns), or
# a transposed buffer (column stride != 1).
X_LAYOUTS = ("contiguous", "padded", "transposed")

# The entries between those of a strided index tensor: out of range, so
# reading one fails or writes something the oracle does not.
GARBAGE = 1000

PROPERTY_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@contextlib.contextmanager
def forced_isa(isa: str):
    """Forces `isa` (DEFAULT_ISA: unsets the variable); restores after."""
    saved = os.environ.get(ISA_ENV)
    if isa == DEFAULT_ISA:
        os.environ.pop(ISA_ENV, None)
    else:
        os.environ[ISA_ENV] = isa
    try:
        if isa != DEFAULT_ISA:
            assert vllm_cpu_lora.isa() == isa
        yield
    finally:
        if saved is None:
            os.environ.pop(ISA_ENV, None)
        else:
            os.environ[ISA_ENV] = saved


# ---------------------------------------------------------------- specs --


@dataclasses.dataclass(frozen=True)
class Spec:
    """The structure of one call; `build` turns it into tensors.

    Attributes:
        op: Op name (torch.ops.vllm_cpu_lora / ops / reference).
        dtypes: dtypes of (inputs, weights, output).
        index_dtype: int32 or int64, for every index tensor.
        tokens: Rows of inputs and output.
        loras: Adapters (first weight dimension).
        k: Reduction length: hidden size (shrink), rank (expand), h_in.
        n: Weight rows: rank (shrink), output size (expand), h_out.
        width: Columns of the output view.
        seed: Seed of the operand values and of the index pattern.
        pattern: Index pattern (bgmv and dispatch ops), see PATTERNS.
        segments: sgmv (start, length, adapter) in call order.
        slice_offset: Slice ops: first output column.
        slice_size: Slice ops: slice width.
        add: Expand ops: add to the output instead of overwriting it.
        scale: Shrink and dispatch ops: the scale.
        w4d: vLLM weights as [L, 1, rows, cols] instead of [L, rows, cols].
        layers: Dispatch ops: layers of w.
        layer: Dispatch ops: layer_idx.
        pad_in: dispatch_bgmv_low_level: w columns past h_in.
        pad_out: dispatch_bgmv_low_level: w rows past h_out.
        y_offset: dispatch_bgmv_low_level: first output column.
        x_layout: See X_LAYOUTS.
        w_padded: Weights are a view of a buffer with longer rows.
        out_padded: The output is a column slice of a wider, poisoned buffer.
        strided_index: Index tensors are every other element of a buffer.
        via_ops: Call through vllm_cpu_lora.ops instead of torch.ops.
    """

    op: str
    dtypes: tuple = (F32, F32, F32)
    index_dtype: torch.dtype = I64
    tokens: int = 4
    loras: int = 2
    k: int = 16
    n: int = 8
    width: int = 8
    seed: int = 0
    pattern: str = "random"
    segments: tuple = ()
    slice_offset: int = 0
    slice_size: int = 0
    add: bool = False
    scale: float = 0.75
    w4d: bool = False
    layers: int = 1
    layer: int = 0
    pad_in: int = 0
    pad_out: int = 0
    y_offset: int = 0
    x_layout: str = "contiguous"
    w_padded: bool = False
    out_padded: bool = False
    strided_index: bool = False
    via_ops: bool = False


dtype_st = st.sampled_from(DTYPES)


@st.composite
def sgmv_segments(draw, loras: int, big: bool):
    """(tokens, segments): segments back to back from token 0 covering every
    token, as vLLM's ops require, each with an adapter or -1, some empty."""
    pieces = draw(
        st.lists(
            st.tuples(st.integers(0, 12), st.integers(-1, loras - 1)),
            max_size=6,
        )
    )
    if big:
        pieces.insert(0, (draw(st.integers(64, 80)), 0))
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(pieces)))
        pieces.insert(at, (0, draw(st.integers(-1, loras - 1))))
    segments = []
    start = 0
    for length, adapter in pieces:
        segments.append((start, length, adapter))
        start += length
    return start, tuple(segments)


@st.composite
def specs(draw, op: str) -> Spec:
    """A Spec for `op`; about one in ten is just large enough for the
    kernels' threaded path (>= 2^17 multiply-adds, counting tokens that have
    an adapter)."""
    big = draw(st.integers(0, 9)) == 0
    loras = draw(st.integers(1, 6))
    fields = {
        "op": op,
        "dtypes": (draw(dtype_st), draw(dtype_st), draw(dtype_st)),
        "index_dtype": draw(st.sampled_from((I32, I64))),
        "loras": loras,
        "seed": draw(st.integers(0, 2**32 - 1)),
        "x_layout": draw(st.sampled_from(X_LAYOUTS)),
        "w_padded": draw(st.booleans()),
        "out_padded": draw(st.booleans()),
        "strided_index": draw(st.booleans()),
        "via_ops": draw(st.booleans()),
        "scale": draw(st.sampled_from((0.75, 1.0, -1.5, 2.0, 0.0))),
    }
    if op.startswith("sgmv"):
        fields["tokens"], fields["segments"] = draw(sgmv_segments(loras, big))
    else:
        fields["tokens"] = draw(st.integers(64, 80) if big else tokens_st)
        fields["pattern"] = draw(st.sampled_from(PATTERNS))

    if op in SHRINK_OPS:
        # Hidden sizes below the rank take the "pack" blocking.
        k = draw(st.integers(512, 700) if big else hidden_st)
        n = draw(st.integers(8, 16) if big else outputs_st(k))
        fields.update(k=k, n=n, width=n + draw(st.integers(0, 4)))
        fields["w4d"] = draw(st.booleans())
    elif op in EXPAND_OPS:
        # Ranks above 256 take the "dot" blocking even for wide outputs.
        k = draw(st.integers(16, 24) if big else rank_st)
        if big:
            n = draw(st.integers(256, 400))
        else:
            # Long reductions only with few outputs, to bound the oracle.
            n = draw(outputs_st(k))
        fields.update(k=k, n=n, add=draw(st.booleans()))
        fields["w4d"] = draw(st.booleans())
        if op.endswith("_slice"):
            # vLLM's slice ops need slice_size equal to the weight rows.
            width = draw(st.integers(n, n + 40))
            size = n
            at_end = draw(st.booleans())
            offset = (
                width - size if at_end else draw(st.integers(0, width - size))
            )
            fields.update(width=width, slice_offset=offset, slice_size=size)
        else:
            # Narrower than the weight rows (clipped) or wider.
            fields["width"] = draw(st.integers(0, n + 20))
    else:
        if big:
            k, n = draw(st.sampled_from(((512, 8), (16, 256))))
        else:
            k = draw(hidden_st)
            n = draw(outputs_st(k))
        layers = draw(st.integers(1, 3))
        fields.update(k=k, n=n, layers=layers)
        fields["layer"] = draw(st.integers(0, layers - 1))
        if op == "dispatch_bgmv_low_level":
            fields["pad_in"] = draw(st.integers(0, 3))
            fields["pad_out"] = draw(st.integers(0, 3))
            fields["y_offset"] = draw(st.integers(0, 5))
        fields["width"] = (
            fields.get("y_offset", 0) + n + draw(st.integers(0, 3))
        )
    return Spec(**fields)


tokens_st = st.one_of(
    st.integers(0, 2), st.integers(3, 20), st.integers(21, 40)
)
hidden_st = st.one_of(st.integers(1, 40), st.integers(41, 300))
rank_st = st.one_of(st.integers(1, 72), st.integers(250, 300))


def outputs_st(k: int):
    """Weight rows for reduction length k: many (several column blocks)
    only for short reductions, which bounds the oracle's work."""
    return st.integers(1, 160 if k <= 40 else 72 if k <= 72 else 24)


# Explicit cases, run before the drawn ones on every ISA. Rows: fields of
# Spec; "segments" is used by the sgmv ops, "pattern" by the others.
_BF16 = (BF16, BF16, BF16)  # With >= 16 tokens per adapter: AMX tiles.
_MIXED = (F32, BF16, BF16)  # fp32 inputs rounded to bf16 (oracle.py).
_TRICKY_SEGMENTS = (  # -1, empty (one at the very end), one adapter twice.
    (0, 3, -1),
    (3, 0, 1),
    (3, 6, 0),
    (9, 5, 1),
    (14, 0, 0),
)
_EDGE_CASES = {
    # (k = hidden, n = rank): H not a multiple of any vector width, rank 1,
    # rank above H (pack blocking), empty reduction, threaded size.
    "shrink": (
        dict(tokens=0, k=33, n=8, segments=()),
        dict(tokens=1, k=33, n=1, pattern="same", segments=((0, 1, 0),)),
        dict(tokens=9, k=17, n=40, pattern="none", index_dtype=I32),
        dict(tokens=7, k=5, n=3, pattern="none", loras=0),
        dict(tokens=6, k=1, n=1, pattern="distinct", loras=6),
        dict(tokens=40, k=33, n=16, pattern="same", dtypes=_BF16),
        dict(tokens=5, k=100, n=8, pattern="runs", dtypes=_MIXED),
        dict(tokens=14, k=0, n=4, segments=_TRICKY_SEGMENTS),
        dict(tokens=70, k=600, n=16, segments=((0, 17, 0), (17, 53, 1))),
    ),
    # (k = rank, n = weight rows, width): output wider than the weights,
    # narrower (clipped), rank 1, empty reduction, threaded size.
    "expand": (
        dict(tokens=0, k=16, n=8, width=8, segments=((0, 0, 1),)),
        dict(tokens=1, k=1, n=1, width=1, pattern="same"),
        dict(tokens=9, k=16, n=33, width=50, add=True, index_dtype=I32),
        dict(tokens=14, k=7, n=45, width=17, segments=_TRICKY_SEGMENTS),
        dict(tokens=7, k=4, n=6, width=6, pattern="none", loras=0, add=True),
        dict(tokens=5, k=0, n=5, width=5, pattern="random"),
        dict(tokens=40, k=16, n=70, width=70, pattern="same", dtypes=_BF16),
        dict(tokens=5, k=8, n=20, width=20, pattern="runs", dtypes=_MIXED),
        dict(tokens=70, k=16, n=300, width=300, pattern="same", add=True),
    ),
    # (k = h_in, n = h_out)
    "dispatch": (
        dict(tokens=0, k=33, n=5),
        dict(tokens=1, k=1, n=1, pattern="same"),
        dict(tokens=9, k=33, n=5, pattern="none", index_dtype=I32),
        dict(tokens=6, k=7, n=45, pattern="distinct", loras=6),
        dict(tokens=5, k=0, n=4, pattern="random"),
        dict(tokens=40, k=33, n=70, pattern="same", dtypes=_BF16),
        dict(tokens=5, k=9, n=20, pattern="runs", dtypes=_MIXED),
        dict(tokens=70, k=16, n=256, pattern="same"),
    ),
}


def edge_specs(op: str) -> list[Spec]:
    """The explicit cases of `op`'s family, adapted to `op`."""
    if op in SHRINK_OPS:
        family = "shrink"
    elif op in EXPAND_OPS:
        family = "expand"
    else:
        family = "dispatch"
    specs_ = []
    for seed, case in enumerate(_EDGE_CASES[family]):
        fields = dict(case, op=op, seed=seed)
        tokens, segments = fields["tokens"], fields.pop("segments", None)
        if op.startswith("sgmv"):
            fields.pop("pattern", None)
            if segments is None:  # One segment per adapter run.
                adapter = -1 if fields.get("loras") == 0 else 0
                segments = ((0, tokens, adapter),)
            fields["segments"] = segments
        elif segments is not None:
            fields.setdefault("pattern", "random")
        if family == "shrink":
            fields["width"] = fields["n"] + 1
        if op.endswith("_slice"):
            # A slice of the weights' rows at the end of a wider output.
            size = fields["n"]
            fields["width"] = max(fields["width"], size) + 3
            fields.update(slice_offset=fields["width"] - size, slice_size=size)
        if family == "dispatch":
            fields.update(layers=2, layer=1, width=fields["n"] + 1)
            if op == "dispatch_bgmv_low_level":
                fields.update(pad_in=2, pad_out=1, y_offset=3)
                fields["width"] += 3
        specs_.append(Spec(**fields))
    if op.endswith("_slice"):
        # Slices in the middle, and at the start.
        for seed, offset in ((100, 7), (101, 0)):
            specs_.append(
                Spec(
                    op=op,
                    tokens=6,
                    k=8,
                    n=20,
                    width=50,
                    slice_offset=offset,
                    slice_size=20,
                    seed=seed,
                    segments=((0, 6, 1),) if op.startswith("sgmv") else (),
                )
            )
    return specs_


# ---------------------------------------------------------------- build --


@dataclasses.dataclass
class Call:
    """A built call: `args` for the op, `out` the position of the output."""

    spec: Spec
    args: list
    out: int
    x: int
    w: int
    scale: int | None
    buffer: torch.Tensor  # The output's whole allocation.

    @property
    def output(self) -> torch.Tensor:
        return self.args[self.out]

    @property
    def adds(self) -> bool:
        return self.spec.add or self.spec.op in DISPATCH_OPS


def _values(shape, dtype, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def _inputs(spec: Spec, gen) -> torch.Tensor:
    t, k = spec.tokens, spec.k
    dtype = spec.dtypes[0]
    if spec.x_layout == "padded":
        return _values((t, k + 3), dtype, gen)[:, 1 : k + 1]
    if spec.x_layout == "transposed":
        return _values((k, t), dtype, gen).t()
    return _values((t, k), dtype, gen)


def _index_tensor(values: list, spec: Spec) -> torch.Tensor:
    """`values` as an index tensor, strided if spec says so."""
    tensor = torch.tensor(values, dtype=spec.index_dtype)
    if spec.strided_index:
        spread = torch.full((2 * len(values),), GARBAGE, dtype=tensor.dtype)
        spread[::2] = tensor
        tensor = spread[::2]
    return tensor


def _pattern(spec: Spec, gen) -> list:
    t, loras = spec.tokens, spec.loras
    if spec.pattern == "none" or loras == 0:
        values = torch.full((t,), -1)
    elif spec.pattern == "same":
        values = torch.full(
            (t,), int(torch.randint(0, loras, (), generator=gen))
        )
    elif spec.pattern == "distinct" and t <= loras:
        values = torch.randperm(loras, generator=gen)[:t]
    elif spec.pattern == "runs":
        values = torch.randint(-1, loras, (t,), generator=gen).sort().values
    else:  # "random", or "distinct" with more tokens than adapters.
        values = torch.randint(-1, loras, (t,), generator=gen)
    if spec.op in DISPATCH_OPS:
        # Legacy punica: every negative value skips the row.
        negatives = torch.tensor([-1, -7, torch.iinfo(spec.index_dtype).min])
        pick = torch.randint(0, 3, (t,), generator=gen)
        values = torch.where(values < 0, negatives[pick], values)
    return values.tolist()


def build(spec: Spec) -> Call:
    """The op's arguments for `spec`; overwrite-mode outputs are NaN."""
    gen = torch.Generator().manual_seed(spec.seed)
    _, w_dtype, out_dtype = spec.dtypes
    t = spec.tokens
    x = _inputs(spec, gen)

    w_pad = 2 if spec.w_padded else 0
    if spec.op in DISPATCH_OPS:
        rows, cols = spec.n + spec.pad_out, spec.k + spec.pad_in
        w_shape = (spec.loras, spec.layers, rows, cols + w_pad)
    elif spec.w4d:
        cols = spec.k
        w_shape = (spec.loras, 1, spec.n, cols + w_pad)
    else:
        cols = spec.k
        w_shape = (spec.loras, spec.n, cols + w_pad)
    w = _values(w_shape, w_dtype, gen)[..., :cols]

    pad = 5 if spec.out_padded else 0
    buffer = torch.full((t, spec.width + pad), float("nan"), dtype=out_dtype)
    out = buffer[:, 2 : 2 + spec.width] if pad else buffer
    adds = spec.add or spec.op in DISPATCH_OPS
    if adds:
        out.copy_(_values(out.shape, out_dtype, gen))

    if spec.op.startswith("sgmv"):
        starts, lengths, adapters = (
            [s[i] for s in spec.segments] for i in range(3)
        )
        segment_args = [
            _index_tensor(starts, spec),
            _index_tensor(lengths, spec),
            _index_tensor(adapters, spec),
            len(spec.segments),
            max(lengths, default=0),
            t,
        ]
    else:
        index = _index_tensor(_pattern(spec, gen), spec)

    op = spec.op
    if op == "bgmv_shrink":
        args = [x, w, out, index, spec.scale]
    elif op == "sgmv_shrink":
        args = [x, w, out, *segment_args, spec.scale]
    elif op == "bgmv_expand":
        args = [x, w, out, index, spec.add]
    elif op == "bgmv_expand_slice":
        args = [x, w, out, index, spec.slice_offset, spec.slice_size, spec.add]
    elif op == "sgmv_expand":
        args = [x, w, out, *segment_args, spec.add]
    elif op == "sgmv_expand_slice":
        args = [x, w, out, *segment_args]
        args += [spec.slice_offset, spec.slice_size, spec.add]
    elif op == "dispatch_bgmv":
        args = [out, x, w, index, spec.layer, spec.scale]
    elif op == "dispatch_bgmv_low_level":
        args = [out, x, w, index, spec.layer, spec.scale]
        args += [spec.k, spec.n, spec.y_offset]
    else:
        raise ValueError(op)

    if op in DISPATCH_OPS:
        return Call(spec, args, out=0, x=1, w=2, scale=5, buffer=buffer)
    scale = len(args) - 1 if op in SHRINK_OPS else None
    return Call(spec, args, out=2, x=0, w=1, scale=scale, buffer=buffer)


# ---------------------------------------------------------------- check --


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of `tensor`'s storage."""
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(tensor.untyped_storage())
    return raw.clone()


def run_kernel(call: Call, isa: str) -> None:
    module = ops if call.spec.via_ops else torch.ops.vllm_cpu_lora
    with forced_isa(isa):
        getattr(module, call.spec.op)(*call.args)


def check(spec: Spec, isa: str) -> None:
    """Runs `spec` on `isa` and checks it against the oracle."""
    call = build(spec)
    abs_inputs = (call.x, call.w)
    if call.scale is not None:
        abs_inputs += (call.scale,)
    want = run_oracle(spec.op, call.args, call.out)
    zero_args = list(call.args)
    zero_args[call.out] = torch.zeros(call.output.shape, dtype=torch.float64)
    magnitude = run_oracle(spec.op, zero_args, call.out, abs_inputs)

    old_view = call.output.clone()
    old_buffer = storage_bytes(call.buffer)
    operands = [
        (i, a, storage_bytes(a))
        for i, a in enumerate(call.args)
        if isinstance(a, torch.Tensor) and i != call.out
    ]

    run_kernel(call, isa)

    got = call.output
    assert_close_to_oracle(
        got,
        want,
        magnitude,
        f64(old_view).abs() if call.adds else None,
        spec.k,
        *spec.dtypes,
        isa,
    )
    if call.adds:
        # Elements no product reaches keep their bits (NaN poison checks
        # this in overwrite mode).
        untouched = magnitude == 0
        assert torch.equal(
            got[untouched].view(torch.int8),
            old_view[untouched].view(torch.int8),
        ), "add mode changed elements it must leave alone"
    for i, tensor, before in operands:
        assert torch.equal(storage_bytes(tensor), before), (
            f"argument {i} was modified"
        )
    # Nothing outside the output view was written.
    got.copy_(old_view)
    assert torch.equal(storage_bytes(call.buffer), old_buffer), (
        "wrote outside the output view"
    )


def _property_test(op: str):
    def test(isa, spec):
        check(spec, isa)

    test.__name__ = test.__qualname__ = f"test_{op}_matches_oracle"
    test = given(spec=specs(op))(test)
    for spec in reversed(edge_specs(op)):
        test = example(spec=spec)(test)
    test = PROPERTY_SETTINGS(test)
    return pytest.mark.parametrize("isa", ISA_PARAMS)(test)


test_bgmv_shrink_matches_oracle = _property_test("bgmv_shrink")
test_bgmv_expand_matches_oracle = _property_test("bgmv_expand")
test_bgmv_expand_slice_matches_oracle = _property_test("bgmv_expand_slice")
test_sgmv_shrink_matches_oracle = _property_test("sgmv_shrink")
test_sgmv_expand_matches_oracle = _property_test("sgmv_expand")
test_sgmv_expand_slice_matches_oracle = _property_test("sgmv_expand_slice")
test_dispatch_bgmv_matches_oracle = _property_test("dispatch_bgmv")
test_dispatch_bgmv_low_level_matches_oracle = _property_test(
    "dispatch_bgmv_low_level"
)


def test_every_op_is_covered():
    names = {n for n in globals() if n.endswith("_matches_oracle")}
    assert names == {f"test_{op}_matches_oracle" for op in ALL_OPS}
    # The multi-slice ops' drawn cases are in tests/test_ops_multi_slice.py.
    assert set(ALL_OPS) | set(MULTI_SLICE_OPS) == set(
        vllm_cpu_lora.reference.__all__
    )
