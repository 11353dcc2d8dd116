"""Correctness of the C++ LoRA ops against `vllm_cpu_lora.reference`.

Every check runs one op on fresh random operands and compares the result with
the float64 oracle of tests/oracle.py under its documented error bound
(`assert_close_to_oracle`), or, for small-integer operands where every step
of the arithmetic is exact, with zero tolerance. Outputs are poisoned with NaN
in overwrite mode, so elements an op must not touch are checked too; in add
mode those elements must keep their old value bit for bit.

Tests that take the `isa` fixture (tests/conftest.py) run once per ISA path
this CPU supports. Seeds derive from the test parameters, so a failure
reproduces with the same test id.
"""

import collections
import dataclasses
import hashlib
import itertools
import zlib

import pytest
import torch
from oracle import (
    ALL_OPS,
    DISPATCH_OPS,
    EXPAND_OPS,
    SHRINK_OPS,
    assert_close_to_oracle,
    f64,
    run_oracle,
)

import vllm_cpu_lora
from vllm_cpu_lora import ops

F32 = torch.float32
BF16 = torch.bfloat16
F16 = torch.float16
DTYPES = (F32, BF16, F16)
DTYPE_NAMES = {F32: "f32", BF16: "bf16", F16: "f16"}
NAN = float("nan")


# (inputs, weights, output) dtypes.
ALL_DTYPE_COMBOS = tuple(itertools.product(DTYPES, repeat=3))
SAME_DTYPE_COMBOS = ((F32, F32, F32), (BF16, BF16, BF16), (F16, F16, F16))
SHRINK_FAST_COMBOS = ((BF16, BF16, F32), *SAME_DTYPE_COMBOS)
EXPAND_FAST_COMBOS = ((F32, BF16, BF16), *SAME_DTYPE_COMBOS)

# Threads the kernels run with (their threaded path needs more than one).
# The oracle and the checks run single-threaded: their work is small
# elementwise float64 code, for which threading costs more than it wins,
# and much more on a busy machine.
KERNEL_THREADS = torch.get_num_threads()

# Adapter index patterns: every row/segment -1, -1 mixed with adapters, one
# adapter for all, distinct (or random when there are more rows than
# adapters).
PATTERNS = ("none", "mixed", "same", "distinct")


@pytest.fixture(autouse=True)
def single_threaded_checks():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dtypes_id(dtypes) -> str:
    return "-".join(DTYPE_NAMES[d] for d in dtypes)


def make_generator(*parts) -> torch.Generator:
    """A generator seeded from the test parameters (stable across runs)."""
    seed = zlib.crc32(repr(parts).encode())
    return torch.Generator().manual_seed(seed)


def _randint(low: int, high: int, gen: torch.Generator) -> int:
    return int(torch.randint(low, high, (), generator=gen))


def make_values(shape, dtype, gen, integers=False) -> torch.Tensor:
    """Random operands: N(0, 1), or integers in [-3, 3] (exact in every
    dtype) when `integers`."""
    if integers:
        values = torch.randint(-3, 4, shape, generator=gen, dtype=torch.int64)
    else:
        values = torch.randn(shape, generator=gen)
    return values.to(dtype)


def make_output(shape, dtype, gen, add, integers=False) -> torch.Tensor:
    """The output before the call: random finite values in add mode, else
    NaN poison."""
    if add:
        return make_values(shape, dtype, gen, integers)
    return torch.full(shape, NAN, dtype=dtype)


# ------------------------------------------------------------- indices --


def bgmv_indices(batch, loras, pattern, gen, dtype) -> torch.Tensor:
    """Per-row adapter indices (-1: no LoRA) following `pattern`."""
    if pattern == "none":
        values = torch.full((batch,), -1)
    elif pattern == "same":
        values = torch.full((batch,), _randint(0, loras, gen))
    elif pattern == "distinct":
        if batch <= loras:
            values = torch.randperm(loras, generator=gen)[:batch]
        else:
            values = torch.randint(0, loras, (batch,), generator=gen)
    elif pattern == "mixed":
        values = torch.randint(-1, loras, (batch,), generator=gen)
        if batch >= 2:
            rows = torch.randperm(batch, generator=gen)
            values[rows[0]] = -1
            values[rows[1]] = _randint(0, loras, gen)
    else:
        raise ValueError(pattern)
    return values.to(dtype)


def dispatch_indices(batch, loras, pattern, gen, dtype) -> torch.Tensor:
    """Legacy punica indices: any negative value skips the row."""
    negatives = torch.tensor([-1, -7, torch.iinfo(dtype).min])
    if pattern in ("none", "mixed"):
        values = negatives[torch.randint(0, 3, (batch,), generator=gen)]
        if pattern == "mixed":
            valid = torch.randint(0, loras, (batch,), generator=gen)
            keep = torch.rand(batch, generator=gen) < 0.5
            if batch >= 2:
                keep[0], keep[1] = True, False
            values = torch.where(keep, valid, values)
        return values.to(dtype)
    return bgmv_indices(batch, loras, pattern, gen, dtype)


@dataclasses.dataclass
class Segments:
    """sgmv segment arguments."""

    starts: torch.Tensor
    lengths: torch.Tensor
    adapters: torch.Tensor
    batches: int
    max_seq_length: int

    def args(self, tokens: int) -> list:
        return [
            self.starts,
            self.lengths,
            self.adapters,
            self.batches,
            self.max_seq_length,
            tokens,
        ]


def sgmv_segments(tokens, loras, pattern, gen, dtype) -> Segments:
    """Segments over `tokens` tokens following `pattern`, back to back from
    token 0 and covering every token, as vLLM's ops require.

    "none": every segment has adapter -1; "same": one adapter; "distinct":
    random adapters; "mixed": adapters, -1 segments and an empty segment;
    "decode": one segment per token, adapters taken in turn with every fifth
    -1 (how vLLM's CPU runner calls sgmv for a decode step).
    """
    if pattern == "decode":
        segments = [(1, -1 if t % 5 == 4 else t % loras) for t in range(tokens)]
    else:
        pieces = min(tokens, 5)
        cuts = []
        if pieces > 1:
            cuts = torch.randperm(tokens - 1, generator=gen)[: pieces - 1] + 1
            cuts = sorted(cuts.tolist())
        bounds = [0, *cuts, tokens] if tokens else [0, 0]
        same = _randint(0, loras, gen)
        segments = []
        for i, (start, stop) in enumerate(itertools.pairwise(bounds)):
            if pattern == "none":
                adapter = -1
            elif pattern == "same":
                adapter = same
            elif pattern == "distinct":
                adapter = _randint(0, loras, gen)
            elif pattern == "mixed":
                adapter = _randint(0, loras, gen) if i % 3 != 1 else -1
            else:
                raise ValueError(pattern)
            segments.append((stop - start, adapter))
        if pattern == "mixed":
            at = _randint(0, len(segments) + 1, gen)
            segments.insert(at, (0, _randint(0, loras, gen)))
    lengths = [length for length, _ in segments]
    starts = list(itertools.accumulate(lengths, initial=0))[:-1]
    return Segments(
        torch.tensor(starts, dtype=dtype),
        torch.tensor(lengths, dtype=dtype),
        torch.tensor([adapter for _, adapter in segments], dtype=dtype),
        len(segments),
        max(lengths, default=0),
    )


# --------------------------------------------------------------- calls --


@dataclasses.dataclass
class Call:
    """One op call and what the oracle needs to judge it.

    Attributes:
        op: The op's name in vllm_cpu_lora.ops / reference.
        args: The arguments, output already poisoned or initialised.
        out: Position of the output tensor in `args`.
        x: Position of the inputs.
        w: Position of the weights.
        scale: Position of the scale argument, None if the op has none.
        k: Reduction length.
        add: Whether the op adds to the old output.
        api: Where the op is looked up: vllm_cpu_lora.ops (default) or
            torch.ops.vllm_cpu_lora.
    """

    op: str
    args: list
    out: int
    x: int
    w: int
    scale: int | None
    k: int
    add: bool
    api: object = ops

    @property
    def output(self) -> torch.Tensor:
        return self.args[self.out]

    @property
    def dtypes(self) -> tuple:
        # The multi-slice ops' weights are a list of one dtype.
        w = self.args[self.w]
        return (
            self.args[self.x].dtype,
            (w[0] if isinstance(w, list) else w).dtype,
            self.output.dtype,
        )


def shrink_call(
    op,
    dtypes,
    *,
    batch,
    hidden,
    rank,
    loras,
    pattern,
    gen,
    integers=False,
    scale=0.75,
    w4d=False,
    index_dtype=torch.int64,
    extra_cols=3,
) -> Call:
    """bgmv_shrink / sgmv_shrink: out[:, :rank] = scale * x @ A.T."""
    x_dtype, w_dtype, out_dtype = dtypes
    x = make_values((batch, hidden), x_dtype, gen, integers)
    w_shape = (loras, 1, rank, hidden) if w4d else (loras, rank, hidden)
    w = make_values(w_shape, w_dtype, gen, integers)
    out = make_output((batch, rank + extra_cols), out_dtype, gen, add=False)
    if op == "bgmv_shrink":
        idx = bgmv_indices(batch, loras, pattern, gen, index_dtype)
        args = [x, w, out, idx, scale]
    else:
        segments = sgmv_segments(batch, loras, pattern, gen, index_dtype)
        args = [x, w, out, *segments.args(batch), scale]
    return Call(op, args, 2, 0, 1, len(args) - 1, hidden, False)


def expand_call(
    op,
    dtypes,
    *,
    batch,
    rank,
    w_rows,
    out_width,
    loras,
    pattern,
    add,
    gen,
    integers=False,
    w4d=False,
    index_dtype=torch.int64,
    slice_size=None,
    slice_offset=None,
) -> Call:
    """bgmv/sgmv_expand(_slice): out[:, off:off+n] (+)= x @ B.T.

    For the slice ops the slice defaults to the last `slice_size` columns
    (default: the lesser of w_rows and out_width - 2), and the weights have
    `slice_size` rows, as vLLM's ops require.
    """
    x_dtype, w_dtype, out_dtype = dtypes
    if op.endswith("_slice"):
        if slice_size is None:
            slice_size = max(0, min(w_rows, out_width - 2))
        if slice_offset is None:
            slice_offset = out_width - slice_size
        w_rows = slice_size
    x = make_values((batch, rank), x_dtype, gen, integers)
    w_shape = (loras, 1, w_rows, rank) if w4d else (loras, w_rows, rank)
    w = make_values(w_shape, w_dtype, gen, integers)
    out = make_output((batch, out_width), out_dtype, gen, add, integers)
    if op.startswith("bgmv"):
        idx = bgmv_indices(batch, loras, pattern, gen, index_dtype)
        args = [x, w, out, idx]
    else:
        segments = sgmv_segments(batch, loras, pattern, gen, index_dtype)
        args = [x, w, out, *segments.args(batch)]
    if op.endswith("_slice"):
        args += [slice_offset, slice_size]
    args.append(add)
    return Call(op, args, 2, 0, 1, None, rank, add)


def dispatch_call(
    op,
    dtypes,
    *,
    batch,
    h_in,
    h_out,
    loras,
    pattern,
    gen,
    integers=False,
    scale=0.75,
    layers=3,
    layer=2,
    pad_in=0,
    pad_out=0,
    y_offset=0,
    y_extra=2,
    index_dtype=torch.int64,
) -> Call:
    """dispatch_bgmv(_low_level): y[:, off:off+h_out] += scale * x @
    w[idx, layer, :h_out, :h_in].T.

    dispatch_bgmv uses all of w (pad_in, pad_out and y_offset must be 0).
    """
    x_dtype, w_dtype, out_dtype = dtypes
    w_shape = (loras, layers, h_out + pad_out, h_in + pad_in)
    w = make_values(w_shape, w_dtype, gen, integers)
    x = make_values((batch, h_in), x_dtype, gen, integers)
    y_shape = (batch, y_offset + h_out + y_extra)
    y = make_output(y_shape, out_dtype, gen, True, integers)
    idx = dispatch_indices(batch, loras, pattern, gen, index_dtype)
    args = [y, x, w, idx, layer, scale]
    if op == "dispatch_bgmv_low_level":
        args += [h_in, h_out, y_offset]
    else:
        assert pad_in == pad_out == y_offset == 0
    return Call(op, args, 0, 1, 2, 5, h_in, True)


def run_kernel(call: Call, isa: str, threads: int = KERNEL_THREADS):
    """Runs the op in place with `threads` threads; returns the output."""
    assert vllm_cpu_lora.isa() == isa
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        getattr(call.api, call.op)(*call.args)
    finally:
        torch.set_num_threads(saved)
    return call.output


_ORACLE_CACHE: collections.OrderedDict = collections.OrderedDict()


def _fingerprint(call: Call) -> str:
    """A digest of everything the oracle's result depends on."""
    digest = hashlib.sha1()
    positions = (call.out, call.x, call.w, call.scale)
    digest.update(repr((call.op, positions)).encode())
    for arg in itertools.chain.from_iterable(
        a if isinstance(a, list) else [a] for a in call.args
    ):
        if isinstance(arg, torch.Tensor):
            digest.update(repr((arg.shape, arg.dtype)).encode())
            digest.update(arg.contiguous().view(torch.uint8).numpy())
        else:
            digest.update(repr(arg).encode())
    return digest.hexdigest()


def oracle(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle's output and the magnitude S = |scale| * sum|x w|
    (the oracle on absolute operands and an all-zero output).

    Cached by the operands' content: the ISA instances of a test case run
    back to back (see tests/conftest.py) on identical operands.
    """
    key = _fingerprint(call)
    if key in _ORACLE_CACHE:
        _ORACLE_CACHE.move_to_end(key)
        return _ORACLE_CACHE[key]
    abs_inputs = (call.x, call.w)
    if call.scale is not None:
        abs_inputs += (call.scale,)
    want = run_oracle(call.op, call.args, call.out)
    zero_args = list(call.args)
    zero_args[call.out] = torch.zeros(call.output.shape, dtype=torch.float64)
    magnitude = run_oracle(call.op, zero_args, call.out, abs_inputs)
    _ORACLE_CACHE[key] = want, magnitude
    while len(_ORACLE_CACHE) > 8:
        _ORACLE_CACHE.popitem(last=False)
    return want, magnitude


def check(call: Call, isa: str | None, run=None) -> None:
    """Runs `call` (on ISA path `isa`, or through `run(call)`, which returns
    the output) and checks it against the oracle's error bound."""
    want, magnitude = oracle(call)
    old = f64(call.output).clone()

    got = run(call) if run is not None else run_kernel(call, isa)

    assert_close_to_oracle(
        got,
        want,
        magnitude,
        old.abs() if call.add else None,
        call.k,
        *call.dtypes,
        isa,
    )
    if call.add:
        # Elements no product reaches (-1 rows, columns past the written
        # width, tokens outside every segment) keep their value exactly.
        # With random normal operands every written element has magnitude
        # > 0.
        untouched = magnitude == 0
        torch.testing.assert_close(
            f64(got)[untouched],
            old[untouched],
            rtol=0,
            atol=0,
            msg=lambda m: f"add mode changed elements it must leave alone\n{m}",
        )


def check_exact(call: Call, isa: str) -> None:
    """Runs `call` (small-integer operands, power-of-two scale) and checks it
    equals the oracle rounded to the output dtype bit for bit."""
    want = oracle(call)[0].to(call.output.dtype)
    got = run_kernel(call, isa)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


# -------------------------------------------------- all dtype combinations --


def moderate_calls(op, dtypes, gen, integers=False, scale=0.75):
    """Calls on moderate shapes that reach both kernel blockings ("dot":
    long reduction; "pack": output wider than the reduction), with odd
    sizes, token tails and, for expand, both add modes."""
    calls = []
    if op in SHRINK_OPS:
        for hidden, rank, w4d in ((37, 5, False), (3, 20, True)):
            calls.append(
                shrink_call(
                    op,
                    dtypes,
                    batch=7,
                    hidden=hidden,
                    rank=rank,
                    loras=3,
                    pattern="mixed",
                    gen=gen,
                    integers=integers,
                    scale=scale,
                    w4d=w4d,
                )
            )
    elif op in EXPAND_OPS:
        # (rank, weight rows, output width): pack with rows < width; dot
        # with rows > width (clipped).
        for (rank, w_rows, width), add in itertools.product(
            ((7, 45, 50), (40, 23, 17)), (False, True)
        ):
            calls.append(
                expand_call(
                    op,
                    dtypes,
                    batch=7,
                    rank=rank,
                    w_rows=w_rows,
                    out_width=width,
                    loras=3,
                    pattern="mixed",
                    add=add,
                    gen=gen,
                    integers=integers,
                    w4d=add,
                    slice_size=min(w_rows, width - 3),
                )
            )
    else:
        low_level = op == "dispatch_bgmv_low_level"
        for h_in, h_out in ((37, 5), (7, 45)):
            calls.append(
                dispatch_call(
                    op,
                    dtypes,
                    batch=7,
                    h_in=h_in,
                    h_out=h_out,
                    loras=3,
                    pattern="mixed",
                    gen=gen,
                    integers=integers,
                    scale=scale,
                    pad_in=3 if low_level else 0,
                    pad_out=2 if low_level else 0,
                    y_offset=4 if low_level else 0,
                )
            )
    return calls


@pytest.mark.parametrize("dtypes", ALL_DTYPE_COMBOS, ids=dtypes_id)
@pytest.mark.parametrize("op", ALL_OPS)
def test_all_dtype_combinations(op, dtypes, isa):
    gen = make_generator("dtypes", op, dtypes)
    for call in moderate_calls(op, dtypes, gen):
        check(call, isa)


# ----------------------------------------------------------- larger grid --

# (batch, hidden, rank, loras). Together they take every H in {1, 2, 15, 33,
# 2049}, rank in {1, 3, 16, 64, 256}, L in {1, 4, 128} and batch in {0, 1, 5,
# 37}, both blockings, the token tails of every tile height and the threaded
# path (>= 2^17 multiply-adds). Rank 1 with H = 8 * 256 + 225 takes the
# one-row tiles through their unrolled steps, the steps left and a part.
SHRINK_SHAPES = (
    (0, 33, 16, 4),
    (1, 1, 1, 1),
    (1, 2049, 256, 1),
    (5, 1, 64, 4),
    (5, 2, 3, 128),
    (5, 15, 256, 4),
    (37, 33, 16, 128),
    (37, 2049, 64, 4),
    (37, 15, 1, 1),
    (5, 2049, 3, 128),
    (37, 2, 256, 4),
    (1, 33, 64, 128),
    (37, 2273, 1, 4),
)

# (batch, rank, weight rows, output width, loras), output width in {1, 17,
# 100, 1000, 4099}; weight rows both above (clipped) and below the output
# width; one-token groups with rank >= 32 take the rows tiles (odd rank 33
# too); groups of ranks 2, 8 and 16 pack rows of 1 to 8 whole dwords
# (AVX-512's SplitRows).
EXPAND_SHAPES = (
    (0, 16, 100, 100, 4),
    (1, 1, 1, 1, 1),
    (1, 256, 4099, 4099, 1),
    (5, 3, 4099, 4099, 4),
    (5, 64, 17, 17, 128),
    (37, 16, 4099, 4099, 4),
    (37, 1, 100, 100, 128),
    (37, 256, 100, 100, 4),
    (5, 256, 17, 17, 4),
    (5, 16, 120, 100, 4),
    (37, 3, 17, 100, 128),
    (5, 64, 4099, 4099, 4),
    (3, 33, 100, 100, 4),
    (37, 8, 4099, 4099, 4),
    (21, 2, 1000, 1000, 2),
)


def _rotation(shape_index: int, dtype_index: int) -> dict:
    """Index pattern, add mode, weight layout and index dtype for one grid
    point: across its four dtype combinations every shape meets every index
    pattern, both add modes, both weight layouts and both index dtypes."""
    turn = shape_index + dtype_index
    return {
        "pattern": PATTERNS[turn % len(PATTERNS)],
        "add": (turn // 2 + shape_index) % 2 == 1,
        "w4d": dtype_index % 2 == 1,
        "index_dtype": torch.int32 if turn % 2 else torch.int64,
    }


@pytest.mark.parametrize(
    "shape", SHRINK_SHAPES, ids=lambda s: "B{}-H{}-r{}-L{}".format(*s)
)
@pytest.mark.parametrize("dtypes", SHRINK_FAST_COMBOS, ids=dtypes_id)
@pytest.mark.parametrize("op", SHRINK_OPS)
def test_shrink_grid(op, dtypes, shape, isa):
    batch, hidden, rank, loras = shape
    shape_index = SHRINK_SHAPES.index(shape)
    rotation = _rotation(shape_index, SHRINK_FAST_COMBOS.index(dtypes))
    del rotation["add"]
    gen = make_generator("shrink_grid", op, dtypes, shape)
    call = shrink_call(
        op,
        dtypes,
        batch=batch,
        hidden=hidden,
        rank=rank,
        loras=loras,
        gen=gen,
        scale=(0.5, -1.3, 2.0)[shape_index % 3],
        **rotation,
    )
    check(call, isa)


# Shrink groups of at least 128 tokens take the pack tiles from 64 ranks
# where the products are bf16 pairs (ShrinkPacks, csrc/cpu/tuning.h) and
# from 16 ranks up to two vectors where they are fp32 FMAs on 16 lanes
# (ShrinkPacksFma). (pattern, hidden, rank, batch, x layout):
# - rank 72 (a whole 64-column tile and a part of one): the pair tiles read
#   bf16 inputs in place where the tokens are consecutive rows and each pair
#   is aligned as one; with rows longer than hidden ("pad2"), and each way
#   out of it: -1 rows among the adapter's tokens ("mixed"), an odd hidden
#   size (a half pair), rows at odd element offsets ("embedded") or an odd
#   number of elements apart ("pad1");
# - ranks 16, 20 and 32 (one vector, part of a second one, two): the FMA
#   tiles' tall tiles, which convert the inputs themselves 16 entries of each
#   token at a time, with a token tail below their height and a partial
#   chunk (odd hidden).
SHRINK_PACK_MIN_TOKENS = 128
SHRINK_PACK_CASES = (
    ("same", 1024, 72, 600, "contiguous"),
    ("same", 1024, 72, 600, "embedded"),
    ("same", 1024, 72, 600, "pad1"),
    ("same", 1024, 72, 600, "pad2"),
    ("mixed", 1024, 72, 600, "contiguous"),
    ("mixed", 1025, 72, 600, "contiguous"),
    ("same", 1025, 16, 140, "contiguous"),
    ("mixed", 1024, 20, 800, "contiguous"),
    ("same", 333, 32, 136, "pad1"),
    ("same", 64, 16, 128, "embedded"),
)


def padded_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """The same values in the first columns of a NaN buffer `pad` columns
    wider."""
    buffer = torch.full((t.size(0), t.size(1) + pad), NAN, dtype=t.dtype)
    view = buffer[:, : t.size(1)]
    view.copy_(t)
    return view


@pytest.mark.parametrize(
    "case", SHRINK_PACK_CASES, ids=lambda c: "{}-h{}-r{}-B{}-{}".format(*c)
)
@pytest.mark.parametrize("dtypes", SHRINK_FAST_COMBOS, ids=dtypes_id)
@pytest.mark.parametrize("op", SHRINK_OPS)
def test_shrink_large_groups(op, dtypes, case, isa):
    pattern, hidden, rank, batch, x_layout = case
    gen = make_generator("shrink_large_groups", op, dtypes, *case)
    call = shrink_call(
        op,
        dtypes,
        batch=batch,
        hidden=hidden,
        rank=rank,
        loras=1,
        pattern=pattern,
        gen=gen,
    )
    if x_layout == "embedded":
        call.args[call.x], _ = embedded(call.args[call.x])
    elif x_layout.startswith("pad"):
        call.args[call.x] = padded_rows(call.args[call.x], int(x_layout[3:]))
    assert tokens_on_adapter(call) >= SHRINK_PACK_MIN_TOKENS
    check(call, isa)


# Shrink groups of a few tokens take the swapped-operand AMX tiles on the
# AMX paths (below AmxMinTokens, csrc/cpu/tuning.h; every count where the
# path is forced). Over more than two 32-element blocks of hidden size they
# zip the inputs a block at a time (RunStreamed, bgmv_amx.h), with one C tile
# per equal group of at most 16 ranks, up to four groups: ranks 8 and 16 (one
# group), 24 (two of 12), 48 and 64 (three and four of 16); ranks 40 and 72
# split into no such groups and zip the whole reduction first. Hidden sizes:
# 3 blocks, 3 blocks and a tail of 2 elements, 4 blocks and a tail of 30,
# and 129 blocks; token counts of every zip width (1, 2, 3-4, 5-8, 9-16) and
# beyond one tile (20). (hidden, rank, tokens):
SWAPPED_SHRINK_CASES = (
    (96, 8, 1),
    (98, 16, 2),
    (158, 24, 3),
    (96, 48, 5),
    (98, 64, 8),
    (158, 8, 9),
    (4128, 16, 16),
    (96, 64, 20),
    (98, 40, 6),
    (158, 72, 4),
)


@pytest.mark.parametrize(
    "case", SWAPPED_SHRINK_CASES, ids=lambda c: "h{}-r{}-B{}".format(*c)
)
@pytest.mark.parametrize(
    "dtypes",
    ((BF16, BF16, F32), (BF16, BF16, BF16), (F32, BF16, BF16)),
    ids=dtypes_id,
)
def test_shrink_swapped_tiles(dtypes, case, isa):
    hidden, rank, tokens = case
    gen = make_generator("shrink_swapped_tiles", dtypes, *case)
    for pattern in ("same", "mixed"):
        call = shrink_call(
            "bgmv_shrink",
            dtypes,
            batch=tokens,
            hidden=hidden,
            rank=rank,
            loras=2,
            pattern=pattern,
            gen=gen,
        )
        check(call, isa)


def tokens_on_adapter(call: Call, adapter: int | None = 0) -> int:
    """How many tokens of a bgmv or sgmv call use `adapter` (None: any)."""
    if call.op.startswith("bgmv"):
        indices, lengths = call.args[3], torch.ones_like(call.args[3])
    else:
        lengths, indices = call.args[4], call.args[5]
    on = indices >= 0 if adapter is None else indices == adapter
    return int(lengths[on].sum())


# Expand groups of at least 32 tokens with ranks above kMaxPackK, up to 512
# (ExpandPacks, csrc/cpu/tuning.h), take the pack tiles from the dot
# strategy: ranks just above 256, odd (a half pair) and the largest, into
# 600 columns (more than the rank, with a partial tile), 45 tokens on one
# adapter (with a partial token tile).
EXPAND_PACK_MIN_TOKENS = 32
EXPAND_PACK_RANKS = (257, 320, 511, 512)


@pytest.mark.parametrize("rank", EXPAND_PACK_RANKS)
@pytest.mark.parametrize("dtypes", EXPAND_FAST_COMBOS, ids=dtypes_id)
@pytest.mark.parametrize("op", EXPAND_OPS)
def test_expand_large_rank_groups(op, dtypes, rank, isa):
    gen = make_generator("expand_large_rank_groups", op, dtypes, rank)
    call = expand_call(
        op,
        dtypes,
        batch=45,
        rank=rank,
        w_rows=600,
        out_width=600,
        loras=1,
        pattern="same",
        add=rank % 2 == 1,
        gen=gen,
    )
    assert tokens_on_adapter(call) >= EXPAND_PACK_MIN_TOKENS
    check(call, isa)


@pytest.mark.parametrize(
    "shape", EXPAND_SHAPES, ids=lambda s: "B{}-r{}-rows{}-Hout{}-L{}".format(*s)
)
@pytest.mark.parametrize("dtypes", EXPAND_FAST_COMBOS, ids=dtypes_id)
@pytest.mark.parametrize("op", EXPAND_OPS)
def test_expand_grid(op, dtypes, shape, isa):
    """Slice ops write the last `Hout` columns of a 5 wider output."""
    batch, rank, w_rows, width, loras = shape
    rotation = _rotation(
        EXPAND_SHAPES.index(shape), EXPAND_FAST_COMBOS.index(dtypes)
    )
    gen = make_generator("expand_grid", op, dtypes, shape)
    call = expand_call(
        op,
        dtypes,
        batch=batch,
        rank=rank,
        w_rows=w_rows,
        out_width=width + (5 if op.endswith("_slice") else 0),
        loras=loras,
        gen=gen,
        slice_size=width,
        **rotation,
    )
    check(call, isa)


# (batch, h_in, h_out, loras, pad_in, pad_out, y_offset)
DISPATCH_SHAPES = (
    (0, 33, 16, 2, 1, 1, 3),
    (1, 1, 1, 1, 0, 0, 0),
    (5, 2049, 16, 4, 3, 5, 7),
    (37, 16, 4099, 4, 0, 1, 1),
    (37, 64, 17, 128, 2, 0, 0),
    (5, 3, 100, 4, 1, 3, 9),
)


DISPATCH_COMBOS = (SHRINK_FAST_COMBOS[0], *EXPAND_FAST_COMBOS)


@pytest.mark.parametrize(
    "shape",
    DISPATCH_SHAPES,
    ids=lambda s: "B{}-in{}-out{}-L{}-pads{}.{}-off{}".format(*s),
)
@pytest.mark.parametrize("dtypes", DISPATCH_COMBOS, ids=dtypes_id)
@pytest.mark.parametrize("op", DISPATCH_OPS)
def test_dispatch_grid(op, dtypes, shape, isa):
    """dispatch_bgmv ignores the pads and offset (it uses all of w)."""
    batch, h_in, h_out, loras, pad_in, pad_out, y_offset = shape
    shape_index = DISPATCH_SHAPES.index(shape)
    rotation = _rotation(shape_index, DISPATCH_COMBOS.index(dtypes))
    gen = make_generator("dispatch_grid", op, dtypes, shape)
    if op == "dispatch_bgmv":
        pad_in = pad_out = y_offset = 0
    call = dispatch_call(
        op,
        dtypes,
        batch=batch,
        h_in=h_in,
        h_out=h_out,
        loras=loras,
        pattern=rotation["pattern"],
        gen=gen,
        scale=(0.5, -1.3, 2.0)[shape_index % 3],
        layers=1 + shape_index % 3,
        layer=shape_index % 3,
        pad_in=pad_in,
        pad_out=pad_out,
        y_offset=y_offset,
        index_dtype=rotation["index_dtype"],
    )
    check(call, isa)


# --------------------------------------------------------- exact integers --


EXACT_PATTERNS = ("mixed", "distinct", "same", "mixed")


def exact_calls(op, dtypes, gen):
    """Small-integer operands on odd sizes (H 2049 and 33) and ranks 1, 3,
    16 and 64, both blockings; scales are powers of two, so every
    intermediate of the kernel is exact."""
    calls = []
    if op in SHRINK_OPS:
        shapes = ((6, 2049, 3), (9, 33, 1), (5, 2, 16), (3, 33, 64))
        for i, (batch, hidden, rank) in enumerate(shapes):
            calls.append(
                shrink_call(
                    op,
                    dtypes,
                    batch=batch,
                    hidden=hidden,
                    rank=rank,
                    loras=3,
                    pattern=EXACT_PATTERNS[i],
                    gen=gen,
                    integers=True,
                    scale=(0.5, -2.0, 0.25, 1.0)[i],
                    w4d=i % 2 == 1,
                )
            )
    elif op in EXPAND_OPS:
        # (batch, rank, weight rows, output width)
        shapes = ((6, 1, 33, 33), (9, 3, 2049, 2049), (5, 16, 90, 100))
        shapes += ((7, 64, 20, 17),)
        for i, (batch, rank, w_rows, width) in enumerate(shapes):
            calls.append(
                expand_call(
                    op,
                    dtypes,
                    batch=batch,
                    rank=rank,
                    w_rows=w_rows,
                    out_width=width + (4 if op.endswith("_slice") else 0),
                    loras=3,
                    pattern=EXACT_PATTERNS[i],
                    add=i % 2 == 0,
                    gen=gen,
                    integers=True,
                    w4d=i % 2 == 1,
                    slice_size=width,
                    # Slices at the end, or in the middle.
                    slice_offset=2 if i % 2 else None,
                )
            )
    else:
        low_level = op == "dispatch_bgmv_low_level"
        for i, (h_in, h_out) in enumerate(((2049, 3), (3, 33), (33, 1))):
            calls.append(
                dispatch_call(
                    op,
                    dtypes,
                    batch=6,
                    h_in=h_in,
                    h_out=h_out,
                    loras=3,
                    pattern=EXACT_PATTERNS[i],
                    gen=gen,
                    integers=True,
                    scale=(0.5, -2.0, 1.0)[i],
                    layer=1 + i % 2,
                    pad_in=2 if low_level else 0,
                    pad_out=3 if low_level else 0,
                    y_offset=5 if low_level else 0,
                )
            )
    return calls


@pytest.mark.parametrize("dtypes", ALL_DTYPE_COMBOS, ids=dtypes_id)
@pytest.mark.parametrize("op", ALL_OPS)
def test_exact_integers(op, dtypes, isa):
    gen = make_generator("exact", op, dtypes)
    for call in exact_calls(op, dtypes, gen):
        check_exact(call, isa)


# ------------------------------------------------------ memory layouts --


# The "rows" tiles of expand (few tokens per adapter, weight rows read in
# place): ranks 4 and 8 (fp32) / 8 and 16 (bf16 pairs) put several rows in one
# vector on AVX-512, ranks 4 (fp32) and 8 (bf16) on AVX2, 32-256 take the
# fixed-rank tiles, 33 the generic ones, and ranks 1 and 2 (rows shorter than
# a vector) always pack; up to
# tuning.h's RowsMaxTokens and RowsMaxTokensAvx2 tokens per adapter, and
# one more.
ROWS_RANKS = (1, 2, 4, 8, 16, 32, 33, 64, 128, 256)
ROWS_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
ROWS_WIDTHS = (1003, 297, 16, 40, 1, 77, 8, 130, 530)


@pytest.mark.parametrize("layout", ("contiguous", "embedded"))
@pytest.mark.parametrize("rank", ROWS_RANKS)
@pytest.mark.parametrize("op", ("bgmv_expand", "bgmv_expand_slice"))
def test_expand_rows_tiles(op, rank, layout, isa):
    """Every token count around the rows/pack switch, output widths with a
    partial last tile of every size class; "embedded": weight rows not
    contiguous (the grouped and fixed-rank tiles must not be used)."""
    gen = make_generator("rows_tiles", op, rank, layout)
    for dtypes in EXPAND_FAST_COMBOS:
        for tokens, width in zip(ROWS_TOKENS, ROWS_WIDTHS, strict=True):
            call = expand_call(
                op,
                dtypes,
                batch=tokens,
                rank=rank,
                w_rows=width,
                out_width=width + (5 if op.endswith("_slice") else 0),
                loras=1,
                pattern="same",
                add=tokens % 2 == 1,
                gen=gen,
                slice_size=width,
            )
            if layout == "embedded":
                w, _ = embedded(call.args[call.w])
                call.args[call.w] = w
            check(call, isa)


# Expand items of at most 32 tokens whose packed blocks take 3 KB or more
# pack and sweep one block of columns at a time (PackBlockByBlock,
# csrc/cpu/tuning.h): ranks on both sides of that size on every path, one
# adapter's token counts past the rows tiles up to one more than the rule's
# 32 ("same"), those counts spread over two adapters and -1 ("mixed"), and
# output widths of a few blocks and of many, the last one partial.
BLOCK_RANKS = (16, 24, 32, 64, 96)
BLOCK_TOKENS = (5, 9, 17, 32, 33)
BLOCK_WIDTHS = (130, 1003)


@pytest.mark.parametrize("rank", BLOCK_RANKS)
@pytest.mark.parametrize("op", ("bgmv_expand", "sgmv_expand"))
def test_expand_pack_block_by_block(op, rank, isa):
    gen = make_generator("block_by_block", op, rank)
    for dtypes in EXPAND_FAST_COMBOS:
        for pattern, batches in (("same", 1), ("mixed", 3)):
            for tokens in BLOCK_TOKENS:
                for width in BLOCK_WIDTHS:
                    call = expand_call(
                        op,
                        dtypes,
                        batch=batches * tokens,
                        rank=rank,
                        w_rows=width,
                        out_width=width,
                        loras=2,
                        pattern=pattern,
                        add=tokens % 2 == 1,
                        gen=gen,
                    )
                    check(call, isa)


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions swapped in memory, so
    the last dimension is not contiguous."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def embedded(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values in a view of a larger NaN buffer: the first
    dimension steps by 2 and every other one sits inside padding, so all
    strides but the last exceed the contiguous ones. Returns (view,
    buffer)."""
    shape = [2 * t.size(0) + 1] + [s + 5 for s in t.shape[1:]]
    if t.is_floating_point():
        buffer = torch.full(shape, NAN, dtype=t.dtype)
    else:
        buffer = torch.full(shape, 1 << 20, dtype=t.dtype)
    index = (slice(1, 1 + 2 * t.size(0), 2),)
    index += tuple(slice(2, 2 + s) for s in t.shape[1:])
    view = buffer[index]
    view.copy_(t)
    return view, buffer


def base_call(op, dtypes, gen, add=False) -> Call:
    """A representative call of `op` (mixed indices, odd sizes; `add`: the
    expand ops' add_inputs)."""
    if op in SHRINK_OPS:
        return shrink_call(
            op,
            dtypes,
            batch=9,
            hidden=70,
            rank=6,
            loras=3,
            pattern="mixed",
            gen=gen,
        )
    if op in EXPAND_OPS:
        return expand_call(
            op,
            dtypes,
            batch=9,
            rank=6,
            w_rows=70,
            out_width=75,
            loras=3,
            pattern="mixed",
            add=add,
            gen=gen,
        )
    low_level = op == "dispatch_bgmv_low_level"
    return dispatch_call(
        op,
        dtypes,
        batch=9,
        h_in=21,
        h_out=40,
        loras=3,
        pattern="mixed",
        gen=gen,
        pad_in=2 if low_level else 0,
        pad_out=1 if low_level else 0,
        y_offset=3 if low_level else 0,
    )


LAYOUTS = ("transposed", "embedded", "broadcast")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "dtypes",
    ((F32, F32, F32), (BF16, BF16, F32), (F32, BF16, BF16)),
    ids=dtypes_id,
)
@pytest.mark.parametrize("op", ALL_OPS)
def test_non_contiguous(op, dtypes, layout, isa):
    """Strided views give the same results as contiguous tensors.

    "transposed": inputs and weights with a non-contiguous last dimension.
    "embedded": inputs, weights, output and index tensors as views into
    larger buffers (the output's surroundings must stay NaN). "broadcast":
    every input row and every adapter the same memory (stride 0).
    """
    call = base_call(op, dtypes, make_generator("layout", op, dtypes, layout))
    args = call.args
    out_buffer = None
    if layout == "transposed":
        args[call.x] = transposed(args[call.x])
        args[call.w] = transposed(args[call.w])
        assert args[call.x].stride(-1) != 1
        assert args[call.w].stride(-1) != 1
    elif layout == "embedded":
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                args[i], buffer = embedded(arg)
                if i == call.out:
                    out_buffer = buffer
    else:
        x, w = args[call.x], args[call.w]
        args[call.x] = x[:1].expand(x.shape)
        args[call.w] = w[:1].expand(w.shape)
    check(call, isa)
    if out_buffer is not None:
        outside = torch.ones(out_buffer.shape, dtype=torch.bool)
        outside[1 : 1 + 2 * call.output.size(0) : 2, 2:-3] = False
        assert out_buffer[outside].isnan().all(), "wrote outside the output"


# ------------------------------------------------------------ edge cases --


@pytest.mark.parametrize("op", ALL_OPS)
def test_empty_reduction(op, isa):
    """Hidden size / rank / h_in 0: the products are 0 (shrink and overwrite
    expand write zeros, add mode changes nothing)."""
    gen = make_generator("empty", op)
    dtypes = (F32, BF16, BF16)
    if op in SHRINK_OPS:
        calls = [
            shrink_call(
                op,
                dtypes,
                batch=5,
                hidden=0,
                rank=4,
                loras=2,
                pattern="mixed",
                gen=gen,
            )
        ]
    elif op in EXPAND_OPS:
        calls = [
            expand_call(
                op,
                dtypes,
                batch=5,
                rank=0,
                w_rows=6,
                out_width=9,
                loras=2,
                pattern="mixed",
                add=add,
                gen=gen,
            )
            for add in (False, True)
        ]
    else:
        calls = [
            dispatch_call(
                op,
                dtypes,
                batch=5,
                h_in=0,
                h_out=6,
                loras=2,
                pattern="mixed",
                gen=gen,
                layer=1,
            )
        ]
    for call in calls:
        check(call, isa)


def check_unread_weights(call: Call, isa: str, poison) -> None:
    """`check`s a call, then that its output stays the same bit for bit
    when `poison(call)` puts NaN into weights the kernels must not read."""
    before = call.output.clone()
    check(call, isa)
    want = call.output.clone()
    call.output.copy_(before)
    poison(call)
    got = run_kernel(call, isa)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def token_adapters(call: Call) -> torch.Tensor:
    """Each input row's adapter in a call (negative: none)."""
    if call.op.startswith("sgmv"):
        return torch.repeat_interleave(call.args[5], call.args[4])
    return call.args[3]  # bgmv's lora_indices_tensor, dispatch's indicies


@pytest.mark.parametrize(
    "dtypes",
    ((F32, BF16, BF16), (BF16, BF16, F32), (F16, F16, F16)),
    ids=dtypes_id,
)
@pytest.mark.parametrize("op", ALL_OPS)
def test_zero_inputs(op, dtypes, isa):
    """Input rows of zeros (of either sign), for all the tokens of one
    adapter and for one token of another: their products are zeros. Add
    mode leaves those rows exactly as they were (`check`), overwrite mode
    writes zeros over the poison. The kernels skip the adapter whose inputs
    are all zeros (vLLM zeroes the slots of adapters without a module),
    reading none of its weights: as BLAS with alpha 0, NaN there changes
    nothing."""
    for add in (False, True) if op in EXPAND_OPS else (False,):
        # The first draw whose tokens use two adapters or more.
        for draw in itertools.count():
            gen = make_generator("zero_inputs", op, dtypes, add, draw)
            call = base_call(op, dtypes, gen, add=add)
            adapters = token_adapters(call)
            used = adapters[adapters >= 0].unique()
            if len(used) >= 2:
                break
        x = call.args[call.x]
        rows = (adapters == used[0]).nonzero().flatten()
        x[rows] = 0.0
        x[rows[::2]] = -0.0
        x[(adapters == used[1]).nonzero().flatten()[0]] = -0.0

        def poison(call, adapter=used[0]):
            call.args[call.w][adapter] = NAN

        check_unread_weights(call, isa, poison)


@pytest.mark.parametrize("rank", (16, 64))
@pytest.mark.parametrize(
    "op", ("sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")
)
def test_sgmv_decode_segments(op, rank, isa):
    """One single-token segment per request, adapters in turn: the segments
    of an adapter are gathered into one group (weights read once)."""
    gen = make_generator("sgmv_decode", op, rank)
    for dtypes in SHRINK_FAST_COMBOS if "shrink" in op else EXPAND_FAST_COMBOS:
        if "shrink" in op:
            call = shrink_call(
                op,
                dtypes,
                batch=37,
                hidden=2049,
                rank=rank,
                loras=4,
                gen=gen,
                pattern="decode",
                scale=0.5,
            )
        else:
            call = expand_call(
                op,
                dtypes,
                batch=37,
                rank=rank,
                w_rows=4099,
                out_width=4099,
                loras=4,
                pattern="decode",
                add=True,
                gen=gen,
            )
        check(call, isa)


@pytest.mark.parametrize("op", ("sgmv_shrink", "sgmv_expand_slice"))
def test_sgmv_no_segments(op, isa):
    """No tokens and batches == 0 is a valid call that writes nothing (with
    tokens, segments must cover them: tests/test_bad_inputs.py)."""
    gen = make_generator("no_segments", op)
    builder = shrink_call if op == "sgmv_shrink" else expand_call
    sizes = (
        {"hidden": 8, "rank": 4}
        if op == "sgmv_shrink"
        else {"rank": 4, "w_rows": 8, "out_width": 10, "add": False}
    )
    call = builder(
        op,
        (F32, F32, F32),
        batch=0,
        loras=2,
        pattern="decode",
        gen=gen,
        **sizes,
    )
    assert call.args[6] == 0  # batches
    check(call, isa)


@pytest.mark.parametrize("op", ("bgmv_shrink", *EXPAND_OPS))
def test_torch_ops_defaults(op, isa):
    """torch.ops.vllm_cpu_lora.<op> called without its optional arguments
    matches the reference's defaults (bgmv_shrink: scaling 1; add_inputs
    True for bgmv, False for sgmv)."""
    gen = make_generator("defaults", op)
    call = base_call(op, (BF16, BF16, F32), gen)
    if op == "bgmv_shrink":
        call.args.pop()  # scaling
        call.scale = None
    else:
        call.args.pop()  # add_inputs
        call.add = op.startswith("bgmv")
        if call.add:
            call.args[call.out] = make_values(call.output.shape, F32, gen)
    call.api = torch.ops.vllm_cpu_lora
    check(call, isa)


def test_ops_module_reaches_the_kernels(monkeypatch):
    """vllm_cpu_lora.ops sends CPU tensors to the C++ ops (not to the
    reference): an unknown forced ISA makes the C++ dispatch fail."""
    monkeypatch.setenv("VLLM_CPU_LORA_ISA", "no_such_isa")
    call = base_call("bgmv_shrink", (F32, F32, F32), make_generator("isa"))
    with pytest.raises(RuntimeError, match="not a known ISA"):
        ops.bgmv_shrink(*call.args)


@pytest.mark.parametrize(
    "dtypes",
    ((BF16, BF16, F32), (F32, F32, F32), (F16, BF16, F32), (BF16, BF16, BF16)),
    ids=dtypes_id,
)
@pytest.mark.parametrize("op", ("bgmv_shrink", "sgmv_shrink", "dispatch_bgmv"))
def test_shrink_split_k(op, dtypes, isa):
    """A shrink with a single block of tokens and work enough for two
    threads splits its reduction between them (RunSplitK): odd k, so the
    parts differ in length and the last is odd; -1 rows; add mode for the
    dispatch op. Checked against the oracle; for fp32 outputs, the result
    must differ in its last bits from the one-thread run, which shows that
    the split path ran (nine tokens x 40 sums of 4097 random products summed
    in two parts: the chance that every one rounds the same is nil)."""
    gen = make_generator("split-k", op, dtypes)
    if op == "dispatch_bgmv":
        call = dispatch_call(
            op,
            dtypes,
            batch=9,
            h_in=4097,
            h_out=40,
            loras=1,
            pattern="mixed",
            gen=gen,
        )
    else:
        call = shrink_call(
            op,
            dtypes,
            batch=9,
            hidden=4097,
            rank=40,
            loras=1,
            pattern="mixed",
            gen=gen,
        )
    one_thread = dataclasses.replace(call, args=list(call.args))
    one_thread.args[call.out] = call.output.clone()

    check(call, isa, run=lambda c: run_kernel(c, isa, threads=2))
    if dtypes[2] == F32:
        run_kernel(one_thread, isa, threads=1)
        assert not torch.equal(call.output, one_thread.output)


# kSplitTokensPerThread and SplitTokensPerThread(bf16 pairs) in tuning.h.
SPLIT_TOKENS_PER_THREAD = {"avx512_bf16": 16, "neon_bf16": 16}
# The parallel expands' splits: fp32 inputs with bf16 weights and output, and
# all fp32; 2 and 3 threads (the 3 share 2 CPUs here).
SPLIT_DTYPES = ((F32, BF16, BF16), (F32, F32, F32))
SPLIT_THREADS = (2, 3)


@pytest.mark.parametrize("threads", SPLIT_THREADS)
@pytest.mark.parametrize("batch", (301, 97))
@pytest.mark.parametrize("dtypes", SPLIT_DTYPES, ids=dtypes_id)
@pytest.mark.parametrize("op", EXPAND_OPS)
def test_expand_token_split(op, dtypes, batch, threads, isa):
    """A parallel expand of enough tokens per thread (64; 16 on the bf16
    pair paths) splits its tokens evenly among the threads: 3 adapters and
    add mode (bgmv with -1 rows, sgmv in random segments), so that thread
    boundaries fall inside groups and the threads' shares of a group differ;
    2 and 3 threads (the 3 share 2 CPUs here). 301 tokens split on every
    path, 97 only on the bf16 pair paths (the others split columns)."""
    gen = make_generator("token-split", op, dtypes, batch)
    call = expand_call(
        op,
        dtypes,
        batch=batch,
        rank=16,
        w_rows=331,
        out_width=331,
        loras=3,
        pattern="mixed" if op.startswith("bgmv") else "distinct",
        add=True,
        gen=gen,
    )
    per_thread = SPLIT_TOKENS_PER_THREAD.get(isa, 64)
    splits = tokens_on_adapter(call, None) >= per_thread * threads
    assert splits == (batch == 301 or per_thread == 16)
    check(call, isa, run=lambda c: run_kernel(c, isa, threads=threads))


# kParallelMacs in tuning.h.
PARALLEL_MACS = 1 << 17


@pytest.mark.parametrize("threads", SPLIT_THREADS)
@pytest.mark.parametrize("loras", (1, 3))
@pytest.mark.parametrize("dtypes", SPLIT_DTYPES, ids=dtypes_id)
@pytest.mark.parametrize("op", EXPAND_OPS)
def test_expand_column_split(op, dtypes, loras, threads, isa):
    """A parallel expand of too few tokens to split them gives each thread an
    equal share of the outputs, cut between column blocks of 64 or moved to
    a group's edge: 15 tokens in add mode (bgmv with -1 rows, sgmv in random
    segments) at rank 32 into 2001 columns; on one adapter the shares end
    inside its columns, on 3 inside groups or at their edges; 2 and 3
    threads (the 3 share 2 CPUs here)."""
    gen = make_generator("column-split", op, dtypes, loras)
    call = expand_call(
        op,
        dtypes,
        batch=15,
        rank=32,
        w_rows=2001,
        out_width=2003,
        loras=loras,
        pattern="mixed" if op.startswith("bgmv") else "distinct",
        add=True,
        gen=gen,
    )
    tokens = tokens_on_adapter(call, None)
    rank, columns = call.args[0].shape[1], call.args[1].shape[-2]
    assert tokens * columns * rank >= PARALLEL_MACS
    assert tokens < SPLIT_TOKENS_PER_THREAD.get(isa, 64) * threads
    check(call, isa, run=lambda c: run_kernel(c, isa, threads=threads))


# ------------------------------------------------------- eager fast path --

EAGER_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _eager(call: Call) -> bool:
    """Calls the op's eager fast path in _C; whether it ran the kernel."""
    return getattr(vllm_cpu_lora._C, "eager_" + call.op)(*call.args)


class _Passthrough(torch.Tensor):
    """A tensor subclass with the default __torch_function__."""


class _SeenOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _SeenFunctions(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", EAGER_OPS)
def test_eager_fast_path_runs_the_kernel(op, isa):
    """On plain CPU tensors (inference tensors and Parameters too) the fast
    path runs the kernel, with the oracle's result and bit for bit the
    dispatched op's."""
    for variant, wrap in (
        ("plain", lambda call: None),
        (
            "parameter",
            lambda call: call.args.__setitem__(
                call.w, torch.nn.Parameter(call.args[call.w], False)
            ),
        ),
    ):
        gen = make_generator("eager", op, variant)
        call = base_call(op, (BF16, BF16, F32), gen)
        wrap(call)
        check(call, isa, run=lambda c: (_eager(c) or None) and c.output)
        dispatched = dataclasses.replace(
            call, args=list(call.args), api=torch.ops.vllm_cpu_lora
        )
        dispatched.args[call.out] = torch.full_like(call.output, NAN)
        call.args[call.out] = torch.full_like(call.output, NAN)
        assert _eager(call)
        run_kernel(dispatched, isa)
        torch.testing.assert_close(
            call.output, dispatched.output, rtol=0, atol=0, equal_nan=True
        )
    with torch.inference_mode():
        call = base_call(op, (BF16, BF16, F32), make_generator("eager", op))
        check(call, isa, run=lambda c: (_eager(c) or None) and c.output)


@pytest.mark.parametrize("op", EAGER_OPS)
def test_eager_fast_path_declines(op):
    """Wherever the dispatcher has more to do than reach the CPU kernel, the
    fast path answers False without touching the output, and ops reaches
    the op through the dispatcher."""
    gen = make_generator("eager-declines", op)

    def declined(call: Call) -> None:
        before = call.output.clone()
        assert _eager(call) is False
        torch.testing.assert_close(
            call.output, before, rtol=0, atol=0, equal_nan=True
        )

    call = base_call(op, (F32, F32, F32), gen)
    call.args[call.x].requires_grad_(True)
    declined(call)
    with torch.no_grad():
        assert _eager(call)

    call = base_call(op, (F32, F32, F32), gen)
    call.args[call.w] = call.args[call.w].as_subclass(_Passthrough)
    declined(call)

    call = base_call(op, (F32, F32, F32), gen)
    call.args[call.x] = call.args[call.x].to("meta")
    declined(call)

    call = base_call(op, (F32, F32, F32), gen)
    scalar = len(call.args) - 1
    call.args[scalar] = torch.tensor(call.args[scalar]).numpy()[()]
    declined(call)

    call = base_call(op, (F32, F32, F32), gen)
    with _SeenOps() as mode:
        declined(call)
        getattr(ops, op)(*call.args)
    assert getattr(torch.ops.vllm_cpu_lora, op).default in mode.seen

    call = base_call(op, (F32, F32, F32), gen)
    with _SeenFunctions() as mode:
        declined(call)
        getattr(ops, op)(*call.args)
    packet = getattr(torch.ops.vllm_cpu_lora, op)
    assert packet in mode.seen or packet.default in mode.seen

    call = base_call(op, (F32, F32, F32), gen)
    with torch._subclasses.fake_tensor.FakeTensorMode() as fake:
        call.args = [
            fake.from_tensor(a) if isinstance(a, torch.Tensor) else a
            for a in call.args
        ]
        assert _eager(call) is False

    with pytest.raises(TypeError, match="takes"):
        getattr(vllm_cpu_lora._C, "eager_" + op)(*call.args[:-1])


def test_eager_fast_path_is_profiled():
    """A fast-path call shows in torch.profiler under the op's name."""
    call = base_call("bgmv_shrink", (BF16, BF16, F32), make_generator("prof"))
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        assert _eager(call)
    names = {event.name for event in prof.events()}
    assert "vllm_cpu_lora::bgmv_shrink" in names


# ------------------------------------------------ registration and tracing --


def opcheck_args(op, variant):
    """Representative arguments for opcheck: variant 0 all fp32, variant 1
    the mixed fast dtypes; finite outputs (opcheck compares them)."""
    gen = make_generator("opcheck", op, variant)
    if variant == 0:
        dtypes = (F32, F32, F32)
    elif op in SHRINK_OPS:
        dtypes = SHRINK_FAST_COMBOS[0]
    else:
        dtypes = EXPAND_FAST_COMBOS[0]
    call = base_call(op, dtypes, gen)
    call.args[call.out] = make_values(call.output.shape, dtypes[2], gen)
    if op in EXPAND_OPS:
        call.args[-1] = variant == 1  # add_inputs
    return tuple(call.args)


@pytest.mark.parametrize("variant", (0, 1))
@pytest.mark.parametrize("op", ALL_OPS)
def test_opcheck(op, variant):
    """Schema (mutation annotations), fake impl and autograd registration of
    torch.ops.vllm_cpu_lora.<op> pass torch.library.opcheck."""
    overload = getattr(torch.ops.vllm_cpu_lora, op).default
    torch.library.opcheck(overload, opcheck_args(op, variant))


def _lora_model(x, a, b, buf, out, idx, starts, lengths, adapters, y, w):
    """Calls every op once, the way a LoRA layer chains them."""
    tokens = x.size(0)
    ops.bgmv_shrink(x, a, buf, idx, 0.5)
    ops.bgmv_expand(buf, b, out, idx, True)
    ops.bgmv_expand_slice(buf, b[:, :20], out, idx, 10, 20, True)
    ops.sgmv_shrink(x, a, buf, starts, lengths, adapters, 3, 6, tokens, 2.0)
    ops.sgmv_expand(buf, b, out, starts, lengths, adapters, 3, 6, tokens)
    ops.sgmv_expand_slice(
        buf, b[:, :9], out, starts, lengths, adapters, 3, 6, tokens, 30, 9, True
    )
    ops.dispatch_bgmv(y, x, w, idx, 1, 0.25)
    ops.dispatch_bgmv_low_level(y, buf, b.unsqueeze(1), idx, 0, 1.5, 4, 5, 2)
    return out * 2, y + 1


def _model_inputs():
    gen = make_generator("compile")
    tokens, hidden, rank, width, loras = 11, 24, 4, 40, 3
    return (
        make_values((tokens, hidden), BF16, gen),  # x
        make_values((loras, rank, hidden), BF16, gen),  # a
        make_values((loras, width, rank), BF16, gen),  # b
        torch.zeros(tokens, rank),  # buf
        make_values((tokens, width), BF16, gen),  # out
        torch.tensor([0, 2, -1, 1, 1, 0, -1, 2, 2, 0, 1]),  # idx
        torch.tensor([0, 5, 11]),  # starts
        torch.tensor([5, 6, 0]),  # lengths
        torch.tensor([1, -1, 2]),  # adapters
        make_values((tokens, rank + 3), F32, gen),  # y
        make_values((loras, 2, rank + 3, hidden), BF16, gen),  # w
    )


def test_torch_compile_fullgraph():
    """A function calling every op traces in one graph (through the fake
    impls) and gives the eager results, returned and mutated alike.

    aot_eager runs the traced, functionalized graph on the real kernels;
    inductor would add ~30 s of C++ compilation for the same check.
    """
    torch._dynamo.reset()
    eager_inputs = _model_inputs()
    compiled_inputs = _model_inputs()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(
        _lora_model, backend=recording_backend, fullgraph=True
    )
    want = _lora_model(*eager_inputs)
    got = compiled(*compiled_inputs)

    assert len(graphs) == 1
    called = {
        node.target
        for node in graphs[0].graph.nodes
        if node.op == "call_function"
    }
    for op in ALL_OPS:
        assert getattr(torch.ops.vllm_cpu_lora, op).default in called or (
            getattr(torch.ops.vllm_cpu_lora, op) in called
        ), f"{op} is not in the traced graph"
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for w, g in zip(eager_inputs, compiled_inputs, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize(
    "dtypes", (SHRINK_FAST_COMBOS[0], EXPAND_FAST_COMBOS[0]), ids=dtypes_id
)
@pytest.mark.parametrize("op", ("bgmv_shrink", "sgmv_expand", "bgmv_expand"))
def test_default_isa(op, dtypes, monkeypatch):
    """Without VLLM_CPU_LORA_ISA the best path runs, with its own per-call
    choices (e.g. AMX tiles only for large groups, from fewer tokens where
    they read the input rows in place: consecutive rows, a hidden size of
    whole 32-element blocks): adapter groups of 1 to 48 tokens in one
    call."""
    monkeypatch.delenv("VLLM_CPU_LORA_ISA", raising=False)
    best = vllm_cpu_lora.isa()
    assert best == vllm_cpu_lora.supported_isas()[0]
    gen = make_generator("default_isa", op, dtypes)
    batch, loras = 60, 4
    if op == "sgmv_expand":
        segments = Segments(
            starts=torch.tensor([0, 40, 41, 56]),
            lengths=torch.tensor([40, 1, 15, 4]),
            adapters=torch.tensor([2, 0, 3, 1]),
            batches=4,
            max_seq_length=40,
        )
    for rank, wide in ((16, 100), (64, 17), (16, 112)):
        if op == "bgmv_shrink":
            call = shrink_call(
                op,
                dtypes,
                batch=batch,
                hidden=wide + 16,
                rank=rank,
                loras=loras,
                pattern="mixed",
                gen=gen,
            )
            # One large group, a few small ones, and -1 rows.
            call.args[3][:batch] = torch.tensor(
                [2] * 48 + [0] + [3] * 7 + [1] * 3 + [-1]
            )
        else:
            call = expand_call(
                op,
                dtypes,
                batch=batch,
                rank=rank,
                w_rows=wide,
                out_width=wide,
                loras=loras,
                pattern="distinct",
                add=rank == 16,
                gen=gen,
            )
            if op == "sgmv_expand":
                call.args[3:9] = segments.args(batch)
            else:
                call.args[3] = torch.tensor([2, 3, 0] * 14 + [1] * 17 + [-1])
        check(call, best)
