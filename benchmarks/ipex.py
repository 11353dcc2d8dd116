"""Intel Extension for PyTorch's CPU punica ops against vllm_cpu_lora.

IPEX 2.8 registers ``torch.ops.torch_ipex.punica_{bgmv,sgmv}_{shrink,expand,
expand_slice}`` for CPU (output argument first). IPEX builds are tied to one
torch release (2.8), so this part runs in a side environment where our
extension was built against that torch: ``scripts/bench_ipex.sh`` makes it
and runs ``python -P -m benchmarks.ipex`` from the checkout root
(``-P`` keeps the checkout's own ``vllm_cpu_lora``, built for the main
environment's torch, off ``sys.path``). Flags: ``--quick``, ``--threads
both|all|1``, ``--out DIR``.

Every case is checked once against ``vllm_cpu_lora.reference`` for both
implementations, then ours (``vllm_cpu_lora.ops``), IPEX (``torch.ops``
directly, its thinnest path) and the reference are timed side by side with
the interleaved rounds of ``benchmarks.kernels``. IPEX only accepts
one dtype for input, weights and output, so on the decode cases it gets a
bf16 buffer between shrink and expand where ours and the reference get
vLLM's float32 one (bytes that are small next to the weights and
activations). A set of small probes records how both handle what vLLM
passes: index -1, vLLM's dtypes and weight layout, odd segment lengths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Callable, Sequence

import torch

import vllm_cpu_lora
from benchmarks import common, kernels
from vllm_cpu_lora import ops, reference

_HIDDEN = 4096
_IMPLS = ("ours", "ipex", "reference")
_OP_NAMES = tuple(
    f"punica_{family}_{kind}"
    for family in ("bgmv", "sgmv")
    for kind in ("shrink", "expand", "expand_slice")
)
# Same sanity tolerance as the kernel benchmark: max |impl - expected| must
# stay below this fraction of the largest change the reference made.
_CHECK_RTOL = 3e-2
_CHECK_ATOL = 1e-2
# A speed-up of ours below this is reported as "IPEX faster".
_PARITY = 1.0
# A multi-threaded case where either side takes this many times its 1-thread
# time waited for a core (see mark_starved).
_STARVED = 2.0


# --------------------------------------------------------------- loading


def load_ipex() -> tuple[object | None, dict]:
    """Imports IPEX and finds its punica ops.

    Returns:
        The ``torch.ops.torch_ipex`` namespace (None when unusable) and a
        description: version, op schemas, or the reason it is unusable.
    """
    info: dict = {"available": False, "version": None, "schemas": {}}
    try:
        import intel_extension_for_pytorch as ipex
    except Exception as exc:  # ImportError, OSError (ABI), version checks.
        info["reason"] = (
            "import intel_extension_for_pytorch failed: "
            f"{type(exc).__name__}: {exc}"
        )
        return None, info
    info["version"] = getattr(ipex, "__version__", "unknown")
    missing = []
    for name in _OP_NAMES:
        try:
            packet = getattr(torch.ops.torch_ipex, name)
            info["schemas"][name] = str(packet.default._schema)
        except (AttributeError, RuntimeError):
            missing.append(name)
    if missing:
        info["reason"] = (
            f"IPEX {info['version']} lacks torch.ops.torch_ipex."
            + ", ".join(missing)
        )
        return None, info
    info["available"] = True
    return torch.ops.torch_ipex, info


def _openmp_runtimes() -> list[str]:
    """OpenMP runtimes mapped into this process (one is wanted: then
    torch.set_num_threads governs IPEX's and our parallel loops alike)."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = set()
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if re.search(r"lib(g|i)omp[^/]*\.so", path):
            found.add(path)
    return sorted(found)


# ------------------------------------------------------------------ cases


@dataclasses.dataclass
class Prepared:
    """One case: each implementation's call, output and initial output.

    ``ipex_expected`` is the reference applied to IPEX's inputs where they
    differ from ours (decode: a bf16 buffer); None where IPEX gets the same
    tensors, and the reference's own output is what both must match.
    """

    calls: dict[str, Callable[[], None]]
    outs: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]
    ipex_expected: torch.Tensor | None


def prepare(case: kernels.Case, ipex_ops, seed: int = 0) -> Prepared:
    """Builds inputs and the three calls for one benchmark case."""
    gen = torch.Generator().manual_seed(seed)
    bf16, fp32 = torch.bfloat16, torch.float32
    h, r, t, n_ad = _HIDDEN, case.rank, case.tokens, case.adapters

    def randn(*shape, scale=1.0, dtype=bf16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    decode = case.family == "bgmv"
    if decode:
        indices = torch.randint(0, n_ad, (t,), generator=gen)
    else:
        seg = t // n_ad
        starts = torch.arange(n_ad) * seg
        lengths = torch.full((n_ad,), seg)
        indices = torch.arange(n_ad)
        seg_args = (starts, lengths, indices, n_ad, seg, t)

    # Inputs and initial output per dtype variant: "vllm" for ours and the
    # reference, "ipex" (everything bf16) for IPEX.
    if case.op.endswith("shrink"):
        x = randn(t, h)
        w = randn(n_ad, r, h, scale=h**-0.5)
        zeros = torch.zeros(t, r, dtype=fp32 if decode else bf16)
        init = {"vllm": zeros, "ipex": zeros.to(bf16)}  # No copy if bf16.
        xs = {"vllm": x, "ipex": x}
    else:
        w = randn(n_ad, case.hout, r, scale=r**-0.5)
        y = randn(t, r, dtype=fp32 if decode else bf16)
        start = randn(t, case.hout, scale=1e-2)
        init = {"vllm": start, "ipex": start}
        xs = {"vllm": y, "ipex": y.to(bf16)}
    variant = {"ours": "vllm", "reference": "vllm", "ipex": "ipex"}
    outs = {name: init[variant[name]].clone() for name in _IMPLS}

    def vllm_call(fn, out, variant_name):
        x_in = xs[variant_name]
        if case.op == "bgmv_shrink":
            return lambda: fn(x_in, w, out, indices, 1.0)
        if case.op == "bgmv_expand":
            return lambda: fn(x_in, w, out, indices, True)
        if case.op == "sgmv_shrink":
            return lambda: fn(x_in, w, out, *seg_args, 1.0)
        return lambda: fn(x_in, w, out, *seg_args, True)

    def ipex_call(out):
        x_in = xs["ipex"]
        if case.op == "bgmv_shrink":
            op = ipex_ops.punica_bgmv_shrink
            return lambda: op(out, x_in, w, indices, 1.0)
        if case.op == "bgmv_expand":
            op = ipex_ops.punica_bgmv_expand
            return lambda: op(out, x_in, w, indices, True)
        if case.op == "sgmv_shrink":
            op = ipex_ops.punica_sgmv_shrink
            return lambda: op(out, x_in, w, indices, lengths, 1.0)
        op = ipex_ops.punica_sgmv_expand
        return lambda: op(out, x_in, w, indices, lengths, True)

    impl_fn = {
        "bgmv_shrink": (ops.bgmv_shrink, reference.bgmv_shrink),
        "bgmv_expand": (ops.bgmv_expand, reference.bgmv_expand),
        "sgmv_shrink": (ops.sgmv_shrink, reference.sgmv_shrink),
        "sgmv_expand": (ops.sgmv_expand, reference.sgmv_expand),
    }[case.op]
    calls = {
        "ours": vllm_call(impl_fn[0], outs["ours"], "vllm"),
        "ipex": ipex_call(outs["ipex"]),
        "reference": vllm_call(impl_fn[1], outs["reference"], "vllm"),
    }
    ipex_expected = None
    if xs["ipex"] is not xs["vllm"] or init["ipex"] is not init["vllm"]:
        ipex_expected = init["ipex"].clone()
        vllm_call(impl_fn[1], ipex_expected, "ipex")()
    return Prepared(
        calls=calls,
        outs=outs,
        initial={name: init[variant[name]] for name in _IMPLS},
        ipex_expected=ipex_expected,
    )


def compare(
    got: torch.Tensor, expected: torch.Tensor, initial: torch.Tensor
) -> dict:
    """Verdict on one output: ok, or the rows that are wrong (NaN counts as
    wrong)."""
    err = (got.float() - expected.float()).abs()
    delta = (expected.float() - initial.float()).abs().max().item()
    tol = _CHECK_RTOL * delta + _CHECK_ATOL
    bad = (~(err <= tol)).any(dim=1).nonzero().flatten().tolist()
    finite = err[torch.isfinite(err)]
    max_err = finite.max().item() if finite.numel() else math.nan
    nan_count = int((~torch.isfinite(got.float())).sum())
    if not bad:
        return {"ok": True, "max_error": max_err, "detail": "ok"}
    if torch.equal(got, initial) and delta > 0:
        detail = "no-op: output left unchanged"
    else:
        detail = (
            f"wrong in {len(bad)} of {got.size(0)} rows "
            f"(first {bad[:6]}); max finite error {max_err:.3g}, "
            f"{nan_count} non-finite values; reference change max "
            f"{delta:.3g}"
        )
    return {
        "ok": False,
        "max_error": max_err,
        "bad_rows": bad,
        "detail": detail,
    }


def check(prep: Prepared) -> tuple[dict, dict]:
    """Runs each implementation once (the first warm-up) and checks it.

    Returns:
        Per implementation the verdict of compare() and the seconds the
        first call took.
    """
    verdicts, first = {}, {}
    # The reference first: its output is what the others must match.
    for name in ("reference", "ours", "ipex"):
        prep.outs[name].copy_(prep.initial[name])
        start = time.perf_counter()
        try:
            prep.calls[name]()
        except Exception as exc:
            first[name] = math.nan
            verdicts[name] = {
                "ok": False,
                "max_error": math.nan,
                "detail": f"raises {type(exc).__name__}: {_first_line(exc)}",
                "raised": True,
            }
            continue
        first[name] = time.perf_counter() - start
        if name == "reference":
            verdicts[name] = {"ok": True, "max_error": 0.0, "detail": "ok"}
            continue
        expected = prep.outs["reference"]
        if name == "ipex" and prep.ipex_expected is not None:
            expected = prep.ipex_expected
        verdicts[name] = compare(prep.outs[name], expected, prep.initial[name])
    return verdicts, first


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


# ----------------------------------------------------------------- probes


@dataclasses.dataclass
class Probe:
    """A small input vLLM may pass, run through ours and IPEX.

    Each side has its own initial output and a reference that computes what
    vLLM's semantics want from that side's inputs.
    """

    name: str
    want: str
    threads: int
    ours_initial: torch.Tensor
    ours: Callable[[torch.Tensor], None]
    ours_reference: Callable[[torch.Tensor], None]
    ipex_initial: torch.Tensor
    ipex: Callable[[torch.Tensor], None]
    ipex_reference: Callable[[torch.Tensor], None]


def _run_side(fn, ref_fn, initial) -> str:
    expected = initial.clone()
    ref_fn(expected)
    out = initial.clone()
    try:
        fn(out)
    except Exception as exc:
        return f"raises {type(exc).__name__}: {_first_line(exc)}"
    return compare(out, expected, initial)["detail"]


def build_probes(ipex_ops, all_threads: int) -> list[Probe]:
    """Small cases on vLLM's contract (reference.py's semantics)."""
    gen = torch.Generator().manual_seed(1234)
    bf16, fp32 = torch.bfloat16, torch.float32
    h, r, n, n_ad, t = 256, 16, 128, 4, 8

    def randn(*shape, scale=1.0, dtype=bf16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def after_slot_of_ones(weights):
        # IPEX reads adapter -1 at weights[-1], one adapter before the
        # tensor: put a slot of ones there so the read stays in bounds.
        buf = torch.ones(weights.size(0) + 1, *weights.shape[1:]).to(
            weights.dtype
        )
        buf[1:] = weights
        return buf[1:]

    x = randn(t, h)
    a = after_slot_of_ones(randn(n_ad, r, h, scale=h**-0.5))
    b = after_slot_of_ones(randn(n_ad, n, r, scale=r**-0.5))
    y32 = randn(t, r, dtype=fp32)
    y16 = y32.to(bf16)
    start = randn(t, n, scale=1e-2)
    idx_neg = torch.tensor([0, -1, 1, 2, -1, 3, 0, 1])
    idx = torch.tensor([0, 3, 1, 2, 2, 3, 0, 1])
    zeros32 = torch.zeros(t, r, dtype=fp32)
    zeros16 = torch.zeros(t, r, dtype=bf16)
    op = ipex_ops
    probes = [
        Probe(
            "bgmv_shrink, index -1 in a decode batch",
            "rows with -1 get zeros",
            all_threads,
            zeros32,
            lambda o: ops.bgmv_shrink(x, a, o, idx_neg, 1.0),
            lambda o: reference.bgmv_shrink(x, a, o, idx_neg, 1.0),
            zeros16,
            lambda o: op.punica_bgmv_shrink(o, x, a, idx_neg, 1.0),
            lambda o: reference.bgmv_shrink(x, a, o, idx_neg, 1.0),
        ),
        Probe(
            "bgmv_expand (add_inputs), index -1 in a decode batch",
            "rows with -1 left untouched",
            all_threads,
            start,
            lambda o: ops.bgmv_expand(y32, b, o, idx_neg, True),
            lambda o: reference.bgmv_expand(y32, b, o, idx_neg, True),
            start,
            lambda o: op.punica_bgmv_expand(o, y16, b, idx_neg, True),
            lambda o: reference.bgmv_expand(y16, b, o, idx_neg, True),
        ),
    ]

    def sgmv_probe(name, want, threads, kind, lens, seg_idx):
        lens_t = torch.tensor(lens)
        starts = torch.cumsum(lens_t, 0) - lens_t
        seg_idx = torch.tensor(seg_idx)
        batches = len(lens)
        hints = (max(lens), sum(lens))
        y = y16
        if kind == "shrink":
            return Probe(
                name,
                want,
                threads,
                zeros16,
                lambda o: ops.sgmv_shrink(
                    x, a, o, starts, lens_t, seg_idx, batches, *hints, 1.0
                ),
                lambda o: reference.sgmv_shrink(
                    x, a, o, starts, lens_t, seg_idx, batches, *hints, 1.0
                ),
                zeros16,
                lambda o: op.punica_sgmv_shrink(o, x, a, seg_idx, lens_t, 1.0),
                lambda o: reference.sgmv_shrink(
                    x, a, o, starts, lens_t, seg_idx, batches, *hints, 1.0
                ),
            )
        return Probe(
            name,
            want,
            threads,
            start,
            lambda o: ops.sgmv_expand(
                y, b, o, starts, lens_t, seg_idx, batches, *hints, True
            ),
            lambda o: reference.sgmv_expand(
                y, b, o, starts, lens_t, seg_idx, batches, *hints, True
            ),
            start,
            lambda o: op.punica_sgmv_expand(o, y, b, seg_idx, lens_t, True),
            lambda o: reference.sgmv_expand(
                y, b, o, starts, lens_t, seg_idx, batches, *hints, True
            ),
        )

    probes.append(
        sgmv_probe(
            "sgmv_shrink, a segment with index -1",
            "its rows get zeros",
            all_threads,
            "shrink",
            [4, 4],
            [-1, 2],
        )
    )
    for threads in dict.fromkeys((all_threads, 1)):
        probes.append(
            sgmv_probe(
                f"sgmv_shrink, segments of 3 and 5 tokens, {threads} thr",
                "each segment uses its adapter",
                threads,
                "shrink",
                [3, 5],
                [1, 2],
            )
        )
        probes.append(
            sgmv_probe(
                f"sgmv_expand, segments of 3 and 5 tokens, {threads} thr",
                "each segment uses its adapter",
                threads,
                "expand",
                [3, 5],
                [1, 2],
            )
        )
    a32, b32, x32 = a.float(), b.float(), x.float()
    start32 = start.float()
    a4 = a.unsqueeze(1)
    probes += [
        Probe(
            "bgmv_shrink with vLLM's dtypes (bf16 in, fp32 buffer)",
            "fp32 output",
            all_threads,
            zeros32,
            lambda o: ops.bgmv_shrink(x, a, o, idx, 1.0),
            lambda o: reference.bgmv_shrink(x, a, o, idx, 1.0),
            zeros32,
            lambda o: op.punica_bgmv_shrink(o, x, a, idx, 1.0),
            lambda o: reference.bgmv_shrink(x, a, o, idx, 1.0),
        ),
        Probe(
            "bgmv_expand with vLLM's dtypes (fp32 buffer in, bf16 out)",
            "bf16 output",
            all_threads,
            start,
            lambda o: ops.bgmv_expand(y32, b, o, idx, True),
            lambda o: reference.bgmv_expand(y32, b, o, idx, True),
            start,
            lambda o: op.punica_bgmv_expand(o, y32, b, idx, True),
            lambda o: reference.bgmv_expand(y32, b, o, idx, True),
        ),
        Probe(
            "bgmv_shrink, everything fp32",
            "fp32 output",
            all_threads,
            zeros32,
            lambda o: ops.bgmv_shrink(x32, a32, o, idx, 1.0),
            lambda o: reference.bgmv_shrink(x32, a32, o, idx, 1.0),
            zeros32,
            lambda o: op.punica_bgmv_shrink(o, x32, a32, idx, 1.0),
            lambda o: reference.bgmv_shrink(x32, a32, o, idx, 1.0),
        ),
        Probe(
            "bgmv_expand (add_inputs), everything fp32",
            "fp32 output",
            all_threads,
            start32,
            lambda o: ops.bgmv_expand(y32, b32, o, idx, True),
            lambda o: reference.bgmv_expand(y32, b32, o, idx, True),
            start32,
            lambda o: op.punica_bgmv_expand(o, y32, b32, idx, True),
            lambda o: reference.bgmv_expand(y32, b32, o, idx, True),
        ),
        Probe(
            "bgmv_shrink, vLLM's 4-D weights [L, 1, r, H]",
            "same as 3-D",
            all_threads,
            zeros16,
            lambda o: ops.bgmv_shrink(x, a4, o, idx, 1.0),
            lambda o: reference.bgmv_shrink(x, a4, o, idx, 1.0),
            zeros16,
            lambda o: op.punica_bgmv_shrink(o, x, a4, idx, 1.0),
            lambda o: reference.bgmv_shrink(x, a4, o, idx, 1.0),
        ),
    ]
    return probes


def run_probes(ipex_ops, all_threads: int) -> list[dict]:
    results = []
    try:
        for probe in build_probes(ipex_ops, all_threads):
            torch.set_num_threads(probe.threads)
            results.append(
                {
                    "name": probe.name,
                    "want": probe.want,
                    "threads": probe.threads,
                    "ours": _run_side(
                        probe.ours, probe.ours_reference, probe.ours_initial
                    ),
                    "ipex": _run_side(
                        probe.ipex, probe.ipex_reference, probe.ipex_initial
                    ),
                }
            )
    finally:
        torch.set_num_threads(all_threads)
    return results


# ---------------------------------------------------------------- running


def run_cases(
    cases: Sequence[kernels.Case],
    ipex_ops,
    budget_s: float,
    sample_s: float,
) -> list[dict]:
    """Checks and times every case with the current torch thread count.

    A case whose IPEX output is wrong is still timed (and flagged): the
    point is its speed; a case where a call raises is not timed.
    """
    threads = torch.get_num_threads()
    results = []
    for i, case in enumerate(cases):
        prep = prepare(case, ipex_ops, seed=i)
        verdicts, first = check(prep)
        row = {
            "label": case.label,
            **dataclasses.asdict(case),
            "family": case.family,
            "hidden": _HIDDEN,
            "threads": threads,
            "load_average": common.load_average(),
            "check": verdicts,
        }
        if any(v.get("raised") for v in verdicts.values()):
            row["median_s"] = {}
            results.append(row)
            print(f"  {case.label:<36} not timed: a call raised")
            continue
        timed = kernels.measure_interleaved(
            prep.calls, budget_s, sample_s, first_call_s=first
        )
        med = {name: timed[name]["median_s"] for name in _IMPLS}
        row.update(
            {
                "timing": timed,
                "median_s": med,
                "ours_vs_ipex": med["ipex"] / med["ours"],
                "ipex_vs_reference": med["reference"] / med["ipex"],
                "ours_vs_reference": med["reference"] / med["ours"],
            }
        )
        results.append(row)
        flags = "".join(
            f"  [{name} WRONG]" for name in _IMPLS if not verdicts[name]["ok"]
        )
        print(
            f"  {case.label:<36} ours {med['ours'] * 1e6:9.1f} us"
            f"  ipex {med['ipex'] * 1e6:9.1f} us"
            f"  ours/ipex speed-up {row['ours_vs_ipex']:6.2f}x"
            f"  ipex vs ref {row['ipex_vs_reference']:6.1f}x{flags}",
            flush=True,
        )
        del prep
    return results


def mark_starved(results: list[dict]) -> None:
    """Flags multi-threaded cases where either side ran >= 2x slower than on
    one thread (needs a 1-thread run of the same case).

    More threads do not make a kernel that much slower by themselves: such
    a case waited for a core (other work on the machine), and its ratio
    says nothing about the kernels. The flag is the same for both sides.
    """
    single = {
        r["label"]: r["median_s"]
        for r in results
        if r["threads"] == 1 and r.get("median_s")
    }
    for r in results:
        one = single.get(r["label"])
        if r["threads"] == 1 or not one or not r.get("median_s"):
            continue
        r["starved"] = any(
            r["median_s"][name] >= _STARVED * one[name]
            for name in ("ours", "ipex")
        )


def summarize(results: list[dict]) -> dict:
    """Geomean speed-ups per thread count and op, and where IPEX wins."""
    summary = {}
    timed = [r for r in results if r.get("median_s")]
    for threads in sorted({r["threads"] for r in timed}, reverse=True):
        rows = [r for r in timed if r["threads"] == threads]
        entry = {}
        for op in ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand"):
            sel = [r["ours_vs_ipex"] for r in rows if r["op"] == op]
            entry[f"{op} ours/IPEX speed-up"] = kernels.geomean(sel)
        entry["all ours/IPEX speed-up"] = kernels.geomean(
            [r["ours_vs_ipex"] for r in rows]
        )
        entry["all IPEX/reference speed-up"] = kernels.geomean(
            [r["ipex_vs_reference"] for r in rows]
        )
        entry["starved cases"] = sum(bool(r.get("starved")) for r in rows)
        fair = [r for r in rows if not r.get("starved")] or rows
        slowest = min(fair, key=lambda r: r["ours_vs_ipex"])
        entry["smallest ours/IPEX speed-up, not starved"] = slowest[
            "ours_vs_ipex"
        ]
        entry["smallest at"] = slowest["label"]
        summary[str(threads)] = entry

    def describe(r):
        return (
            f"{r['label']} ({r['threads']} thr, {r['ours_vs_ipex']:.2f}x, "
            f"load {r.get('load_average', math.nan):.1f})"
        )

    clean = [r for r in timed if not r.get("starved")]
    wins = [describe(r) for r in clean if r["ours_vs_ipex"] < _PARITY]
    starved_wins = [
        describe(r)
        for r in timed
        if r.get("starved") and r["ours_vs_ipex"] < _PARITY
    ]
    if wins:
        line = (
            f"IPEX is faster than ours in {len(wins)} of {len(clean)} "
            "cases: " + "; ".join(wins) + "."
        )
    elif clean:
        slowest = min(clean, key=lambda r: r["ours_vs_ipex"])
        line = (
            f"IPEX is faster in none of the {len(clean)} cases; the closest "
            f"is {slowest['label']} ({slowest['threads']} thr), where ours "
            f"is {slowest['ours_vs_ipex']:.2f}x faster."
        )
    else:
        line = "No case was timed."
    if starved_wins:
        line += (
            f" Not counted: {len(starved_wins)} starved cases (a side ran "
            f">= {_STARVED:g}x slower than on 1 thread: it waited for a "
            "core) where IPEX came out ahead: " + "; ".join(starved_wins) + "."
        )
    return {
        "per_threads": summary,
        "ipex_wins": wins,
        "ipex_wins_starved": starved_wins,
        "line": line,
    }


# ---------------------------------------------------------------- outputs


def _fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}" if math.isfinite(seconds) else "n/a"


def results_table(results: list[dict]) -> list[str]:
    head = (
        "threads",
        "case",
        "ours, us",
        "IPEX, us",
        "reference, us",
        "ours over IPEX",
        "IPEX over reference",
        "load",
        "IPEX check",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        med = r.get("median_s") or {}
        check = r["check"]["ipex"]
        cells = [
            str(r["threads"]),
            r["label"],
            _fmt_us(med.get("ours", math.nan)),
            _fmt_us(med.get("ipex", math.nan)),
            _fmt_us(med.get("reference", math.nan)),
            f"{r['ours_vs_ipex']:.2f}x" if med else "n/a",
            f"{r['ipex_vs_reference']:.1f}x" if med else "n/a",
            f"{r.get('load_average', math.nan):.1f}"
            + (" starved" if r.get("starved") else ""),
            "ok" if check["ok"] else check["detail"],
        ]
        if not r["check"]["ours"]["ok"]:
            cells[-1] += f"; OURS: {r['check']['ours']['detail']}"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_markdown(path, report: dict) -> None:
    m = report["machine"]
    ipex = report["ipex"]
    lines = [
        "# Intel Extension for PyTorch's punica ops vs vllm_cpu_lora",
        "",
        "Generated by `scripts/bench_ipex.sh` (`python -P -m "
        "benchmarks.ipex"
        + (" --quick" if report["quick"] else "")
        + "` in the side environment) on "
        + f"{m['date']} in {report['elapsed_s']:.0f} s.",
        "",
    ]
    if not ipex["available"]:
        lines += [
            "**Not run:** " + ipex.get("reason", "IPEX unavailable") + ".",
            "",
        ]
        pathlib.Path(path).write_text("\n".join(lines))
        return
    lines += [
        f"**Summary:** {report['summary']['line']}",
        "",
        "## Machine and versions",
        "",
        f"- CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs; torch uses "
        f"{m['threads_all']} threads)",
        f"- Flags: {' '.join(m['flags'])}",
        f"- torch {m['torch']} (PyPI's Linux wheel, a CUDA build, run on "
        f"the CPU), IPEX {ipex['version']}, Python {m['python']}",
        f"- vllm_cpu_lora built against that torch: {m['build_note']}; "
        f"ISA path `{m['isa_path']}`",
        f"- OpenMP runtimes in the process: "
        f"{', '.join(m['openmp_runtimes']) or 'none found'} (one runtime: "
        "`torch.set_num_threads` sets IPEX's thread count too)",
        f"- 1-minute load average {m['load_average_start']:.1f} at the "
        f"start, {m['load_average_end']:.1f} at the end (a shared machine: "
        "ratios within ~10% of 1 are noise, and 2-thread figures are the "
        "noisiest).",
        "",
        "## Method",
        "",
        "- ours = `vllm_cpu_lora.ops` (vLLM's call path); IPEX = "
        "`torch.ops.torch_ipex.punica_*` called directly (IPEX's thinnest "
        "path; `ipex.llm.functional.*` adds a Python wrapper); reference = "
        "`vllm_cpu_lora.reference` (vLLM's per-token gather).",
        "- Each case is checked once against the reference for every "
        "implementation (on its own inputs), then timed: interleaved "
        "rounds, order rotating, medians over rounds after warm-up (the "
        "kernel benchmark's `measure_interleaved`).",
        "- bgmv (decode): x bf16 [T, 4096], A bf16 [L, r, 4096]; "
        "expand B bf16 [L, N, r] into bf16 [T, N] with add_inputs; a random "
        "adapter per token. Ours and the reference use vLLM's float32 "
        "buffer (shrink output, expand input). **IPEX rejects mixed dtypes** "
        "(input, weights and output must all be bf16 or all fp16), so it "
        "gets a bf16 buffer: the same work give or take T x r elements.",
        "- sgmv (prefill): 2048 tokens in 4 segments of 512, one adapter "
        "each, bf16 everywhere (same tensors for all three). IPEX's sgmv "
        "takes no `b_seq_start_loc`: segments must be back to back from "
        "token 0 (they are here, as in vLLM).",
        "- 'ours over IPEX' = IPEX time / our time (above 1: ours is "
        "faster); 'IPEX over reference' = reference time / IPEX time; "
        "'load' = the 1-minute load average when the case started (this "
        "run counts for up to its thread count; above that, other work "
        "competed for the cores, and a parallel region that waits for its "
        "last thread can swamp either side's time). 'starved' = a "
        "multi-threaded case where either side took >= "
        f"{_STARVED:g}x its 1-thread time: it waited for a core, so its "
        "ratio is not evidence either way and the summary does not count "
        "it.",
        "",
        "IPEX's op schemas:",
        "",
        "```",
        *ipex["schemas"].values(),
        "```",
        "",
        "## Probes: what vLLM passes",
        "",
        "Small cases (H=256, r=16, N=128, 8 tokens, 4 adapters) checked "
        "against `vllm_cpu_lora.reference`. For index -1 the weights sit "
        "right after a slot of ones in one allocation, so an implementation "
        "that reads adapter -1 reads that slot instead of memory outside "
        "the tensor.",
        "",
        "| probe | vLLM's semantics | ours | IPEX |",
        "|---|---|---|---|",
    ]
    for p in report["probes"]:
        lines.append(
            f"| {p['name']} | {p['want']} | {p['ours']} | {p['ipex']} |"
        )
    failures = [
        f"{r['label']} ({r['threads']} thr): {name}: "
        + r["check"][name]["detail"]
        for r in report["results"]
        for name in _IMPLS
        if not r["check"][name]["ok"]
    ]
    lines += ["", "Benchmark cases whose check failed: none."]
    if failures:
        lines[-1] = "Benchmark cases whose check failed:"
        lines += ["", *[f"- {f}" for f in failures]]
    lines += [
        "",
        "## Results",
        "",
        *results_table(report["results"]),
        "",
        "## Summary (geomeans over cases)",
        "",
    ]
    per = report["summary"]["per_threads"]
    keys = sorted(per, key=int, reverse=True)
    lines.append("| figure | " + " | ".join(f"{k} thr" for k in keys) + " |")
    lines.append("|---|" + "---|" * len(keys))
    for key in next(iter(per.values()), {}):
        vals = []
        for k in keys:
            v = per[k][key]
            vals.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append(f"| {key} | " + " | ".join(vals) + " |")
    lines += ["", report["summary"]["line"], ""]
    pathlib.Path(path).write_text("\n".join(lines))


def write_plot(path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if r.get("median_s")]
    labels = list(dict.fromkeys(r["label"] for r in timed))
    pos = {label: i for i, label in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(max(10, 0.14 * len(labels) + 3), 6))
    colors = {
        "bgmv_shrink": "C0",
        "bgmv_expand": "C1",
        "sgmv_shrink": "C2",
        "sgmv_expand": "C3",
    }
    markers = {}
    for threads in sorted({r["threads"] for r in timed}, reverse=True):
        markers[threads] = "o" if not markers else "^"
        for op, color in colors.items():
            sel = [
                r for r in timed if r["threads"] == threads and r["op"] == op
            ]
            for starved in (False, True):
                part = [r for r in sel if bool(r.get("starved")) == starved]
                if not part:
                    continue
                ax.scatter(
                    [pos[r["label"]] for r in part],
                    [r["ours_vs_ipex"] for r in part],
                    s=16,
                    marker=markers[threads],
                    facecolors="none" if starved else color,
                    edgecolors=color,
                    label=f"{op}, {threads} thr" + (", starved" * starved),
                )
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_ylabel("speed-up of ours over IPEX (IPEX time / ours)")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=90, fontsize=5)
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(
        "vllm_cpu_lora vs IPEX punica ops (same process; hollow: starved, "
        "a side waited for a core)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_outputs(out_dir: pathlib.Path, report: dict) -> None:
    (out_dir / "ipex.json").write_text(
        json.dumps(report, indent=1, allow_nan=True, default=str)
    )
    write_markdown(out_dir / "ipex.md", report)
    if report.get("results"):
        write_plot(out_dir / "ipex.png", report["results"])


# ------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return common.parse_args(
        argv, __doc__.split("\n")[0], "small subset (smoke test)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out or common.default_out_dir(args.quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    all_threads = torch.get_num_threads()
    thread_counts = common.thread_counts(args.threads, all_threads)
    ipex_ops, ipex_info = load_ipex()
    machine = kernels.describe_machine(all_threads)
    machine["build_note"] = os.environ.get(
        "VLLM_CPU_LORA_BUILD_NOTE", "from " + vllm_cpu_lora.__file__
    )
    machine["vllm_cpu_lora_file"] = vllm_cpu_lora.__file__
    machine["openmp_runtimes"] = _openmp_runtimes()
    report = {
        "machine": machine,
        "ipex": ipex_info,
        "quick": args.quick,
        "threads": thread_counts,
        "probes": [],
        "results": [],
    }
    print(f"CPU: {machine['cpu']}; torch {machine['torch']}")
    if ipex_ops is None:
        print(f"IPEX not usable: {ipex_info['reason']}", file=sys.stderr)
        machine["load_average_end"] = common.load_average()
        report["elapsed_s"] = time.perf_counter() - started
        report["summary"] = {"line": ipex_info["reason"]}
        write_outputs(out_dir, report)
        return 2
    print(
        f"IPEX {ipex_info['version']}; vllm_cpu_lora "
        f"{machine['vllm_cpu_lora_file']} ISA {machine['isa_path']}; "
        f"threads {thread_counts}"
    )

    report["probes"] = run_probes(ipex_ops, all_threads)
    for p in report["probes"]:
        print(f"  probe {p['name']}: ours {p['ours']}; IPEX {p['ipex']}")

    # The cases only (bf16, a random adapter per token, its widths):
    # the kernel benchmark's extra fp32 and shared-adapter cases are left out.
    cases = [
        c for c in kernels.build_cases(args.quick) if getattr(c, "core", True)
    ]
    budget_s = 0.15 if args.quick else 0.3
    sample_s = 1e-3 if args.quick else 2e-3
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            print(f"\n[{threads} thread(s)]")
            report["results"] += run_cases(cases, ipex_ops, budget_s, sample_s)
    finally:
        torch.set_num_threads(all_threads)

    machine["load_average_end"] = common.load_average()
    mark_starved(report["results"])
    report["summary"] = summarize(report["results"])
    report["elapsed_s"] = time.perf_counter() - started
    write_outputs(out_dir, report)
    print(f"\n{report['summary']['line']}")
    print(
        f"{len(report['results'])} cases in {report['elapsed_s']:.0f} s; "
        f"results in {out_dir}"
    )
    ours_wrong = [
        r["label"] for r in report["results"] if not r["check"]["ours"]["ok"]
    ]
    return 1 if ours_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
