"""Concurrent calls from Python threads, and memory growth over many calls.

Threads: each op runs from several Python threads at once, every thread on
its own tensors, and every result must equal, bit for bit, the result of the
same call made alone (which is itself checked against the oracle). Half the
calls are large enough for the kernels' at::parallel_for (>= 2^17
multiply-adds), so the intra-op thread pool is entered from several threads
at once too.

Leaks: resident memory (and glibc's count of heap bytes in use) must stay
flat over 10^5 calls of each op, and the ops must not keep references to
their arguments. The RSS tests are the slow
ones (about a second per op and dtype); their names contain "slow", so
`-k "not slow"` leaves them out locally. CI runs them. They are skipped under
scripts/sanitize.sh, where ASan's quarantine and shadow memory make RSS
meaningless.
"""

import ctypes
import dataclasses
import gc
import os
import sys
import threading

import pytest
import torch
from oracle import ALL_OPS, assert_close_to_oracle, f64, run_oracle

import vllm_cpu_lora

ISA_ENV = "VLLM_CPU_LORA_ISA"
SANITIZED = os.environ.get("VLLM_CPU_LORA_SANITIZED") == "1"

OPS = ALL_OPS
SHRINK_LIKE = ("bgmv_shrink", "sgmv_shrink", "dispatch_bgmv")

THREADS = 4
CALLS_PER_THREAD = 200


@dataclasses.dataclass
class Case:
    """One call on its own tensors.

    Attributes:
        op: The op name.
        args: Its arguments.
        out: Position of the output in `args`.
        x: Position of the inputs.
        w: Position of the weights.
        scale: Position of the scale, or None.
        k: Reduction length.
        adds: Whether the op adds to the output.
        initial: The output before the call (restored before each call).
    """

    op: str
    args: list
    out: int
    x: int
    w: int
    scale: int | None
    k: int
    adds: bool
    initial: torch.Tensor = None

    @property
    def output(self) -> torch.Tensor:
        return self.args[self.out]

    def run(self) -> None:
        getattr(torch.ops.vllm_cpu_lora, self.op)(*self.args)

    def reset(self) -> None:
        self.output.copy_(self.initial)


def make_case(op, *, tokens, big, dtype=torch.float32, seed=0) -> Case:
    """A call of `op` with mixed adapters (some rows / segments -1).

    `big`: shrink-like ops reduce over 1024 inputs to 16 outputs, expand-like
    ones 16 to 1024, enough for at::parallel_for with 64 tokens. Otherwise
    24 and 8.
    """
    gen = torch.Generator().manual_seed(seed)
    loras = 4
    wide, narrow = (1024, 16) if big else (24, 8)
    k, n = (wide, narrow) if op in SHRINK_LIKE else (narrow, wide)
    if op == "dispatch_bgmv_low_level":
        k, n = wide, narrow

    def values(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    def nan(*shape):
        return torch.full(shape, float("nan"), dtype=dtype)

    indices = torch.randint(-1, loras, (tokens,), generator=gen)
    indices[0] = 1  # Both kinds of rows in every case.
    indices[-1] = -1
    quarter = tokens // 4
    segments = [
        torch.tensor([0, quarter, 2 * quarter, 3 * quarter]),
        torch.tensor([quarter, quarter, quarter, tokens - 3 * quarter]),
        torch.tensor([2, -1, 0, 3]),
        4,
        tokens - 3 * quarter,
        tokens,
    ]
    x = values(tokens, k)
    if op.startswith("dispatch"):
        w = values(loras, 2, n, k)
        y = values(tokens, n + 3)
        args = [y, x, w, indices, 1, 0.5]
        if op == "dispatch_bgmv_low_level":
            args += [k, n, 2]
        case = Case(op, args, 0, 1, 2, 5, k, True)
    elif op in SHRINK_LIKE:
        w = values(loras, n, k)
        out = nan(tokens, n)
        if op == "bgmv_shrink":
            args = [x, w, out, indices, 0.5]
        else:
            args = [x, w, out, *segments, 0.5]
        case = Case(op, args, 2, 0, 1, len(args) - 1, k, False)
    else:
        w = values(loras, n, k)
        add = op == "bgmv_expand"  # One read-modify-write op.
        out = values(tokens, n + 8) if add else nan(tokens, n + 8)
        if op.startswith("bgmv"):
            args = [x, w, out, indices]
        else:
            args = [x, w, out, *segments]
        if op.endswith("_slice"):
            args += [4, n]
        args.append(add)
        case = Case(op, args, 2, 0, 1, None, k, add)
    case.initial = case.output.clone()
    return case


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` reinterpreted as integers, so NaN poison compares equal."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def check_against_oracle(case: Case) -> None:
    """Runs `case` once (from its initial output) and checks the oracle."""
    case.reset()
    abs_inputs = (case.x, case.w)
    if case.scale is not None:
        abs_inputs += (case.scale,)
    want = run_oracle(case.op, case.args, case.out)
    zero_args = list(case.args)
    zero_args[case.out] = torch.zeros(case.output.shape, dtype=torch.float64)
    magnitude = run_oracle(case.op, zero_args, case.out, abs_inputs)
    case.run()
    dtype = case.output.dtype
    old = f64(case.initial).abs() if case.adds else None
    assert_close_to_oracle(
        case.output,
        want,
        magnitude,
        old,
        case.k,
        dtype,
        dtype,
        dtype,
        vllm_cpu_lora.isa(),
    )


def run_threads(cases: list[Case], calls: int) -> list[str]:
    """Each case in its own thread, `calls` times; returns mismatches."""
    expected = []
    for case in cases:
        check_against_oracle(case)
        expected.append(case.output.clone())
    barrier = threading.Barrier(len(cases))
    errors = []
    lock = threading.Lock()

    def worker(case: Case, want: torch.Tensor) -> None:
        try:
            with lock:
                # OpenMP's thread count is per calling thread: make sure
                # the large calls take the parallel path here too.
                if torch.get_num_threads() < 2:
                    torch.set_num_threads(2)
            barrier.wait()
            for i in range(calls):
                case.reset()
                case.run()
                if not torch.equal(bits(case.output), bits(want)):
                    errors.append(f"{case.op}: call {i} differs")
                    return
        except Exception as exc:  # noqa: BLE001  (reported by the test)
            errors.append(f"{case.op}: {type(exc).__name__}: {exc}")

    threads = [
        threading.Thread(target=worker, args=(case, want))
        for case, want in zip(cases, expected, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.parametrize("op", OPS)
def test_threads_get_the_single_thread_result(op):
    cases = [
        make_case(op, tokens=64 if i % 2 == 0 else 13, big=i % 2 == 0, seed=i)
        for i in range(THREADS)
    ]
    errors = run_threads(cases, CALLS_PER_THREAD)
    assert not errors, errors


@pytest.mark.parametrize("isa", vllm_cpu_lora.supported_isas())
def test_threads_on_every_isa(isa, monkeypatch):
    """Per-thread kernel state (AMX tile configuration, the emulated tiles)
    under concurrency: bf16 operands, large groups, every op at once."""
    monkeypatch.setenv(ISA_ENV, isa)  # Set before any thread starts.
    cases = [
        make_case(op, tokens=64, big=True, dtype=torch.bfloat16, seed=i)
        for i, op in enumerate(OPS)
    ]
    errors = run_threads(cases, 20)
    assert not errors, errors


# ------------------------------------------------------------------ leaks --

# Calls per measurement, and the growth allowed over them: 100 KiB over 10^5
# calls is ~1 byte per call. Measured on this suite (x86-64, glibc): no
# growth at all (0 bytes, RSS and heap) for every op and dtype; an injected
# leak of 2 bytes per call (a buffer that grows like a std::vector) gives
# +196 KiB RSS and +240 KiB heap, twice the limit; one lost malloc(2) per call
# (a 32-byte chunk) gives +3 MiB.
#
# RSS alone can hide a leak that reuses memory freed earlier and still
# resident (a test process has plenty), so free memory is returned to the OS
# (malloc_trim) before each reading, and glibc's count of heap bytes in use
# (mallinfo2) is checked too.
LEAK_CALLS = 100_000
LEAK_LIMIT_BYTES = 100 * 1024
WARMUP_CALLS = 5_000


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_LIBC = ctypes.CDLL(None)
_GLIBC = hasattr(_LIBC, "malloc_trim") and hasattr(_LIBC, "mallinfo2")
if _GLIBC:
    _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
    _LIBC.mallinfo2.restype = _MallInfo2


def rss_bytes() -> int:
    """Resident memory, after returning free heap memory to the OS."""
    gc.collect()
    if _GLIBC:
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def heap_bytes() -> int:
    """Bytes allocated with malloc and not freed (0 without glibc)."""
    if not _GLIBC:
        return 0
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def memory_growth(run, calls: int) -> tuple[int, int]:
    """(RSS, heap) growth over `calls` calls of `run`, after a warm-up."""
    for _ in range(WARMUP_CALLS):
        run()
    rss, heap = rss_bytes(), heap_bytes()
    for _ in range(calls):
        run()
    return rss_bytes() - rss, heap_bytes() - heap


def assert_flat(run, calls: int) -> None:
    rss, heap = memory_growth(run, calls)
    assert rss < LEAK_LIMIT_BYTES and heap < LEAK_LIMIT_BYTES, (
        f"over {calls} calls RSS grew {rss} bytes, heap in use {heap} bytes"
    )


skip_sanitized = pytest.mark.skipif(
    SANITIZED, reason="ASan quarantine and shadow memory inflate RSS"
)


@skip_sanitized
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("op", OPS)
def test_slow_rss_flat(op, dtype, monkeypatch):
    """10^5 small calls; the bf16 ones on AMX tiles where the CPU has them
    (forced, so every group uses tiles; they allocate buffers per call)."""
    if dtype == torch.bfloat16 and "amx" in vllm_cpu_lora.supported_isas():
        monkeypatch.setenv(ISA_ENV, "amx")
    case = make_case(op, tokens=16, big=False, dtype=dtype)
    assert_flat(case.run, LEAK_CALLS)


# The threaded path costs ~50 us a call: 2 * 10^4 calls, so the limit
# catches >= 5 bytes per call there.
PARALLEL_LEAK_CALLS = 20_000


@skip_sanitized
@pytest.mark.parametrize("op", ("bgmv_shrink", "sgmv_expand"))
def test_slow_rss_flat_parallel_path(op):
    case = make_case(op, tokens=64, big=True, dtype=torch.bfloat16)
    assert_flat(case.run, PARALLEL_LEAK_CALLS)


@pytest.mark.parametrize("op", OPS)
def test_no_references_kept(op):
    case = make_case(op, tokens=8, big=False)
    tensors = [a for a in case.args if isinstance(a, torch.Tensor)]
    before = [sys.getrefcount(t) for t in tensors]
    for _ in range(1000):
        case.run()
    gc.collect()
    assert [sys.getrefcount(t) for t in tensors] == before
