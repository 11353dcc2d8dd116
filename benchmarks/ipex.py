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
the interleaved rounds of ``benchmarks.timing``. IPEX only accepts
one dtype for input, weights and output, so on the decode cases it gets a
bf16 buffer between shrink and expand where ours and the reference get
vLLM's float32 one (bytes that are small next to the weights and
activations). A set of small probes records how both handle what vLLM
passes: index -1, vLLM's dtypes and weight layout, odd segment lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import vllm_cpu_lora
from benchmarks import baselines, common, ipex_report, kernels, machine, timing
from benchmarks.baselines import reference
from benchmarks.ipex_probes import compare, first_line, run_probes
from benchmarks.ipex_report import IMPLS, STARVED
from vllm_cpu_lora import ops

_OP_NAMES = tuple(
    f"punica_{family}_{kind}"
    for family in ("bgmv", "sgmv")
    for kind in ("shrink", "expand", "expand_slice")
)


# --------------------------------------------------------------- loading


def load_ipex() -> tuple[Any, dict[str, Any]]:
    """Imports IPEX and finds its punica ops.

    Returns:
        The ``torch.ops.torch_ipex`` namespace (None when unusable) and a
        description: version, op schemas, or the reason it is unusable.
    """
    info: dict[str, Any] = {"available": False, "version": None, "schemas": {}}
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


def prepare(case: kernels.Case, ipex_ops: Any, seed: int = 0) -> Prepared:
    """Builds inputs and the three calls for one benchmark case."""
    gen = torch.Generator().manual_seed(seed)
    bf16, fp32 = torch.bfloat16, torch.float32
    h, r, t, n_ad = kernels.HIDDEN, case.rank, case.tokens, case.adapters

    randn = functools.partial(baselines.randn, gen)

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
    outs = {name: init[variant[name]].clone() for name in IMPLS}

    def vllm_call(
        fn: Callable[..., None], out: torch.Tensor, variant_name: str
    ) -> Callable[[], None]:
        x_in = xs[variant_name]
        if case.op == "bgmv_shrink":
            return lambda: fn(x_in, w, out, indices, 1.0)
        if case.op == "bgmv_expand":
            return lambda: fn(x_in, w, out, indices, True)
        if case.op == "sgmv_shrink":
            return lambda: fn(x_in, w, out, *seg_args, 1.0)
        return lambda: fn(x_in, w, out, *seg_args, True)

    def ipex_call(out: torch.Tensor) -> Callable[[], None]:
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
        initial={name: init[variant[name]] for name in IMPLS},
        ipex_expected=ipex_expected,
    )


def check(
    prep: Prepared,
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
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
                "detail": f"raises {type(exc).__name__}: {first_line(exc)}",
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


def run_cases(
    cases: Sequence[kernels.Case],
    ipex_ops: Any,
    budget_s: float,
    sample_s: float,
) -> list[dict[str, Any]]:
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
            "hidden": kernels.HIDDEN,
            "threads": threads,
            "load_average": machine.load_average(),
            "check": verdicts,
        }
        if any(v.get("raised") for v in verdicts.values()):
            row["median_s"] = {}
            results.append(row)
            print(f"  {case.label:<36} not timed: a call raised")
            continue
        timed = timing.measure_interleaved(
            prep.calls, budget_s, sample_s, first_call_s=first
        )
        med = {name: timed[name]["median_s"] for name in IMPLS}
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
            f"  [{name} WRONG]" for name in IMPLS if not verdicts[name]["ok"]
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


def mark_starved(results: list[dict[str, Any]]) -> None:
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
            r["median_s"][name] >= STARVED * one[name]
            for name in ("ours", "ipex")
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the comparison; 2 if IPEX is unusable, 1 if ours is wrong."""
    started = time.perf_counter()
    args, out_dir, all_threads, thread_counts = common.start(
        argv, __doc__.split("\n")[0], "small subset (smoke test)"
    )
    ipex_ops, ipex_info = load_ipex()
    info = machine.describe_machine(all_threads)
    info["build_note"] = os.environ.get(
        "VLLM_CPU_LORA_BUILD_NOTE", "from " + vllm_cpu_lora.__file__
    )
    info["vllm_cpu_lora_file"] = vllm_cpu_lora.__file__
    info["openmp_runtimes"] = _openmp_runtimes()
    report = {
        "machine": info,
        "ipex": ipex_info,
        "quick": args.quick,
        "threads": thread_counts,
        "probes": [],
        "results": [],
    }
    print(f"CPU: {info['cpu']}; torch {info['torch']}")
    if ipex_ops is None:
        print(f"IPEX not usable: {ipex_info['reason']}", file=sys.stderr)
        info["load_average_end"] = machine.load_average()
        report["elapsed_s"] = time.perf_counter() - started
        report["summary"] = {"line": ipex_info["reason"]}
        ipex_report.write_outputs(out_dir, report)
        return 2
    print(
        f"IPEX {ipex_info['version']}; vllm_cpu_lora "
        f"{info['vllm_cpu_lora_file']} ISA {info['isa_path']}; "
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

    info["load_average_end"] = machine.load_average()
    mark_starved(report["results"])
    report["summary"] = ipex_report.summarize(report["results"])
    report["elapsed_s"] = time.perf_counter() - started
    ipex_report.write_outputs(out_dir, report)
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
