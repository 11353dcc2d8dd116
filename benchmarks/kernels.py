"""Kernel benchmark: vllm_cpu_lora.ops against vLLM's algorithm and a bound.

Run with ``python -m benchmarks`` (which runs this part) or
``python -m benchmarks.kernels`` (``--quick`` for a smoke test,
``--threads all|1|both``, ``--out DIR``).

Speed is reported as ratios of medians measured side by side in one process:

* ours: ``vllm_cpu_lora.ops`` (the C++ kernels);
* reference: ``vllm_cpu_lora.reference`` (vLLM's per-token gather algorithm);
* grouped: pure torch (``benchmarks.baselines``), tokens grouped by adapter
  with one ``torch.mm`` per adapter (a Python loop over the adapters in use);
* bound: ``max(bytes / bandwidth, flops / peak)`` from figures measured on
  this machine by small C++ micro-kernels compiled at run time
  (``benchmarks.machine``: AVX-512 or AVX2 loads for read bandwidth, a
  register loop of ``vdpbf16ps`` / ``vfmadd``, and AMX ``tdpbf16ps`` where
  present, for peak), each with one thread and with all threads; the peak
  is the one the ISA path of our kernels can use.

The implementations are interleaved round by round (the order rotates), each
sample runs a call in a loop long enough to time, and each median is taken
over many rounds after warm-up; rounds are bounded by a time budget so the
slow reference cases finish, and spread over several passes through all
cases so that a slow spell of a shared machine does not take all of a case's
rounds. Every case is checked once against the reference before it is timed.
The one absolute time quoted is the fixed cost of a tiny B=1 call, which has
an absolute target.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks import baselines, common, kernels_report, machine, timing
from benchmarks.baselines import reference
from vllm_cpu_lora import ops

HIDDEN = 4096
_RANKS = (8, 16, 64)
_ADAPTERS = (1, 4, 16)
_TOKENS = (1, 8, 32, 256)
HOUTS = (4096, 11008)
_LLAMA3_HOUTS = (1024, 14336)
_PREFILL_TOKENS = 2048
_PREFILL_SEGMENTS = 4
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

IMPLS = ("ours", "reference", "grouped")
# Passes through all cases sharing each case's rounds (timing.measure_spread).
_PASSES = 6

# ------------------------------------------------------------------ cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case."""

    op: str  # bgmv_shrink, bgmv_expand, sgmv_shrink, sgmv_expand
    tokens: int
    adapters: int
    rank: int
    hout: int = 0  # Expand only.
    dtype: str = "bf16"  # Activations and weights: a key of _DTYPES.
    shared: bool = False  # Every token on one adapter (else random).

    @property
    def family(self) -> str:
        """bgmv (decode) or sgmv (prefill)."""
        return self.op.split("_", 1)[0]

    @property
    def core(self) -> bool:
        """One of the cases the issue's targets are defined over."""
        return (
            self.dtype == "bf16"
            and not self.shared
            and self.rank in _RANKS
            and self.hout in (0, *HOUTS)
        )

    @property
    def label(self) -> str:
        """The case's name in tables and plots."""
        text = f"{self.op} T{self.tokens} L{self.adapters} r{self.rank}"
        if self.op.endswith("expand"):
            text += f" N{self.hout}"
        if self.dtype != "bf16":
            text += f" {self.dtype}"
        return text + (" shared" if self.shared else "")


def build_cases(quick: bool) -> list[Case]:
    """The issue's cases (or a small subset with quick)."""
    ranks = (16,) if quick else _RANKS
    adapters = (1, 16) if quick else _ADAPTERS
    tokens = (1, 32) if quick else _TOKENS
    houts = (4096,) if quick else HOUTS
    cases = []
    for r in ranks:
        for n_adapters in adapters:
            for b in tokens:
                cases.append(Case("bgmv_shrink", b, n_adapters, r))
                for hout in houts:
                    cases.append(Case("bgmv_expand", b, n_adapters, r, hout))
    for r in ranks:
        cases.append(Case("sgmv_shrink", _PREFILL_TOKENS, _PREFILL_SEGMENTS, r))
        for hout in houts:
            cases.append(
                Case("sgmv_expand", _PREFILL_TOKENS, _PREFILL_SEGMENTS, r, hout)
            )
    if quick:
        return cases
    # Beyond the targets' grid: every token on one adapter, fp32 and fp16
    # throughout (#16 wants their weights at least as fast as torch),
    # Llama-3-8B's widths (k/v 1024, MLP 14336; its hidden size is 4096),
    # and rank 1, the smallest max_lora_rank vLLM allows.
    for b in (1, 8, 256):
        cases.append(Case("bgmv_shrink", b, 4, 1))
        cases.append(Case("bgmv_expand", b, 4, 1, 4096))
    for b in (1, 32, 256):
        cases.append(Case("bgmv_shrink", b, 16, 16, shared=True))
        cases.append(Case("bgmv_expand", b, 16, 16, 11008, shared=True))
        for dtype in ("fp32", "fp16"):
            cases.append(Case("bgmv_shrink", b, 4, 16, dtype=dtype))
            cases.append(Case("bgmv_expand", b, 4, 16, 11008, dtype=dtype))
        for hout in _LLAMA3_HOUTS:
            cases.append(Case("bgmv_expand", b, 4, 16, hout))
    segs = _PREFILL_SEGMENTS
    for dtype in ("fp32", "fp16"):
        cases.append(
            Case("sgmv_shrink", _PREFILL_TOKENS, segs, 16, dtype=dtype)
        )
        cases.append(
            Case("sgmv_expand", _PREFILL_TOKENS, segs, 16, 11008, dtype=dtype)
        )
    for hout in _LLAMA3_HOUTS:
        cases.append(Case("sgmv_expand", _PREFILL_TOKENS, segs, 16, hout))
    return cases


@dataclasses.dataclass
class Prepared:
    """Callables for one case, each with its own output tensor."""

    calls: dict[str, Callable[[], None]]
    outs: dict[str, torch.Tensor]
    initial_out: torch.Tensor
    adapters_used: int
    bytes: int
    flops: int


def prepare(case: Case, seed: int = 0) -> Prepared:
    """Builds inputs, the three implementations' calls and the cost model."""
    gen = torch.Generator().manual_seed(seed)
    # bf16 and fp16: vLLM's CPU dtypes (16-bit activations and weights, the
    # fp32 intermediate buffer between shrink and expand); fp32: all fp32.
    dtype = _DTYPES[case.dtype]
    randn = functools.partial(baselines.randn, gen, dtype=dtype)
    h, r, t, n_ad = HIDDEN, case.rank, case.tokens, case.adapters

    if case.family == "bgmv" and case.shared:
        indices = torch.full((t,), n_ad - 1)
        used = 1
    elif case.family == "bgmv":
        indices = torch.randint(0, n_ad, (t,), generator=gen)
        used = int(torch.unique(indices).numel())
    else:
        seg = t // _PREFILL_SEGMENTS
        starts = torch.arange(_PREFILL_SEGMENTS) * seg
        lengths = torch.full((_PREFILL_SEGMENTS,), seg)
        indices = torch.arange(_PREFILL_SEGMENTS) % n_ad
        used = int(torch.unique(indices).numel())
        seg_args = (starts, lengths, indices, _PREFILL_SEGMENTS)
        hints = (seg, t)  # max_seq_length, token_nums

    if case.op.endswith("shrink"):
        x = randn(t, h)
        w = randn(n_ad, r, h, scale=h**-0.5)
        out_dtype = torch.float32 if case.family == "bgmv" else dtype
        initial = torch.zeros(t, r, dtype=out_dtype)
        nbytes = (
            used * r * h * w.element_size()
            + x.numel() * x.element_size()
            + initial.numel() * initial.element_size()
        )
        flops = 2 * t * r * h
        last = 1.0  # scaling
    else:
        n = case.hout
        in_dtype = torch.float32 if case.family == "bgmv" else dtype
        x = randn(t, r, dtype=in_dtype)
        w = randn(n_ad, n, r, scale=r**-0.5)
        initial = randn(t, n, scale=1e-2)
        nbytes = (
            used * n * r * w.element_size()
            + x.numel() * x.element_size()
            + 2 * initial.numel() * initial.element_size()
        )
        flops = 2 * t * r * n
        last = True  # add_inputs

    outs = {name: initial.clone() for name in IMPLS}
    fns = (
        getattr(ops, case.op),
        getattr(reference, case.op),
        getattr(baselines, f"grouped_{case.op}"),
    )
    if case.family == "bgmv":
        args = {name: (indices, last) for name in IMPLS}
    else:
        vllm_args = (*seg_args, *hints, last)
        args = {"ours": vllm_args, "reference": vllm_args}
        args["grouped"] = (*seg_args, last)  # No hints.

    def bind(fn: Callable[..., None], name: str) -> Callable[[], None]:
        out, rest = outs[name], args[name]
        return lambda: fn(x, w, out, *rest)

    calls = {name: bind(f, name) for name, f in zip(IMPLS, fns, strict=True)}
    return Prepared(calls, outs, initial, used, nbytes, flops)


def check(prep: Prepared) -> tuple[dict[str, float], dict[str, float]]:
    """Runs every implementation once (also the first warm-up).

    Returns:
        max |impl - reference| / max |reference delta| for ours and grouped,
        and the seconds each first call took.

    Raises:
        AssertionError: an implementation is far from the reference.
    """
    first = {}
    for name in IMPLS:
        prep.outs[name].copy_(prep.initial_out)
        first[name] = timing.time_calls(prep.calls[name], 1)
    want = prep.outs["reference"].float()
    delta = (want - prep.initial_out.float()).abs().max().item()
    errors = {}
    for name in ("ours", "grouped"):
        got = prep.outs[name].float()
        err = (got - want).abs().max().item()
        errors[name] = err / max(delta, 1e-30)
        if not err <= baselines.CHECK_RTOL * delta + baselines.CHECK_ATOL:
            raise AssertionError(
                f"{name} differs from the reference: max abs error {err:.3g}"
                f" (reference delta max {delta:.3g})"
            )
    return errors, first


def fixed_cost(quick: bool) -> dict[str, float]:
    """Median microseconds of a tiny B=1 bgmv_shrink (r=16, H=16, L=1)."""
    x = torch.randn(1, 16).to(torch.bfloat16)
    w = torch.randn(1, 16, 16).to(torch.bfloat16)
    out = torch.zeros(1, 16)
    idx = torch.zeros(1, dtype=torch.long)
    raw = torch.ops.vllm_cpu_lora.bgmv_shrink
    calls = {
        "ops": lambda: ops.bgmv_shrink(x, w, out, idx, 1.0),
        "torch_ops": lambda: raw(x, w, out, idx, 1.0),
    }
    for fn in calls.values():
        for _ in range(200):
            fn()
    timed = timing.measure_interleaved(
        calls, budget_s=0.3 if quick else 1.5, sample_s=2e-3, max_rounds=400
    )
    return {name: v["median_s"] * 1e6 for name, v in timed.items()}


# ---------------------------------------------------------------- running


def run_cases(
    cases: Sequence[Case],
    limits: machine.Limits,
    isa_path: str,
    budget_s: float,
    sample_s: float,
    passes: int,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Checks every case, then times them all with the current threads."""
    threads = torch.get_num_threads()
    checked, failures = [], []
    desc = f"{threads} thread(s), checking"
    for i, case in enumerate(common.progress(cases, desc)):
        prep = prepare(case, seed=i)
        try:
            errors, first = check(prep)
        except AssertionError as exc:  # Never time a wrong kernel.
            failures.append(f"{case.label} (threads {threads}): {exc}")
            common.say(f"  {case.label:<36} CHECK FAILED: {exc}")
            continue
        checked.append((case, prep, errors, first))
    common.say(f"  timing {len(checked)} cases in {passes} pass(es)")
    timings = timing.measure_spread(
        [prep.calls for _, prep, _, _ in checked],
        passes,
        budget_s,
        sample_s,
        first_call_s=[first for *_, first in checked],
    )
    results = [
        _result(case, prep, errors, timed, limits, isa_path)
        for (case, prep, errors, _), timed in zip(checked, timings, strict=True)
    ]
    for result in results:
        common.say(
            f"  {result['label']:<40} vs ref "
            f"{result['speedup_vs_reference']:8.1f}x  vs grouped "
            f"{result['speedup_vs_grouped']:7.2f}x  bound "
            f"{100 * result['fraction_of_bound']:6.1f}% "
            f"({result['bandwidth_level']}, {result['bound_by']})"
        )
    return results, failures


def _result(
    case: Case,
    prep: Prepared,
    errors: dict[str, float],
    timed: dict[str, dict[str, Any]],
    limits: machine.Limits,
    isa_path: str,
) -> dict[str, Any]:
    """One case's row: its timings as ratios and fractions of its bound."""
    bf16_peak, bf16_peak_name = limits.bf16_peak(isa_path)
    med = {name: timed[name]["median_s"] for name in IMPLS}
    bandwidth, level = limits.bandwidth_for(prep.bytes)
    mem_s = prep.bytes / bandwidth
    peak, peak_name = limits.peak_for(isa_path, case.dtype == "bf16")
    flop_s = prep.flops / peak
    bound = max(mem_s, flop_s)
    return {
        "label": case.label,
        **dataclasses.asdict(case),
        "family": case.family,
        "core": case.core,
        "hidden": HIDDEN,
        "threads": torch.get_num_threads(),
        "adapters_used": prep.adapters_used,
        "bytes": prep.bytes,
        "flops": prep.flops,
        "bandwidth_level": level,
        "compute_peak": peak_name,
        "bf16_peak": bf16_peak_name,
        "bound_s": bound,
        "bound_by": "memory" if mem_s >= flop_s else "compute",
        "timing": timed,
        "median_s": med,
        "check_rel_error": errors,
        "speedup_vs_reference": med["reference"] / med["ours"],
        "speedup_vs_grouped": med["grouped"] / med["ours"],
        "grouped_vs_reference": med["reference"] / med["grouped"],
        "fraction_of_bound": bound / med["ours"],
        "fraction_of_bf16_peak": prep.flops / med["ours"] / bf16_peak,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the kernel benchmark; 1 if a kernel failed its check."""
    started = time.perf_counter()
    args, out_dir, all_threads, thread_counts = common.start(
        argv, __doc__.split("\n")[0], "small subset (smoke test)"
    )
    info = machine.describe_machine(all_threads)
    print(f"CPU: {info['cpu']}; flags: {' '.join(info['flags'])}")
    print(
        f"torch {info['torch']}, threads {thread_counts}, "
        f"ISA path {info['isa_path']}"
    )
    if info["load_average_start"] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: load average {info['load_average_start']:.1f} on "
            f"{os.cpu_count()} CPUs: other work will skew the figures"
        )

    micro = machine.load_micro_kernels()
    cases = build_cases(args.quick)
    budget_s = 0.15 if args.quick else 0.5
    sample_s = 1e-3 if args.quick else 2e-3
    passes = 1 if args.quick else _PASSES

    limits: dict[int, machine.Limits] = {}
    fixed: dict[int, dict[str, float]] = {}
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    gbs = machine.gbs
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            lim = machine.measure_limits(micro, threads, args.quick)
            limits[threads] = lim
            print(
                f"\n[{threads} thread(s)] read GB/s: L2 {gbs(lim.l2_read)}, "
                f"L3 {gbs(lim.l3_read)}, DRAM {gbs(lim.dram_read)}; "
                f"GFLOP/s: vdpbf16ps {gbs(lim.bf16_dot_peak)}, "
                f"fp32 FMA {gbs(lim.fp32_fma_peak)}, "
                f"AMX {gbs(lim.amx_bf16_peak)}"
            )
            fixed[threads] = fixed_cost(args.quick)
            print(
                f"  B=1 fixed cost: ops {fixed[threads]['ops']:.2f} us, "
                f"torch.ops {fixed[threads]['torch_ops']:.2f} us"
            )
            res, fails = run_cases(
                cases, lim, info["isa_path"], budget_s, sample_s, passes
            )
            results += res
            failures += fails
    finally:
        torch.set_num_threads(all_threads)

    info["load_average_end"] = machine.load_average()
    run = kernels_report.Run(
        info, limits, fixed, results, failures, args.quick, all_threads, passes
    )
    run.elapsed_s = time.perf_counter() - started
    kernels_report.finish(run, out_dir)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
