"""Layer benchmark: LoRA's share of a Llama-2-7B decoder layer's time.

Run with ``python -m benchmarks.layer`` (``--quick`` for a smoke
test, ``--threads both|all|1``, ``--out DIR``).

The layer is Llama-2-7B's in bf16, computed the way vLLM does it: RMSNorm,
the fused q/k/v projection as one GEMM ([12288, 4096]), o_proj, a residual
add, RMSNorm, the fused gate/up projection as one GEMM ([22016, 4096]),
SiLU(gate) * up, down_proj ([4096, 11008]) and a residual add, each
projection through ``torch.nn.functional.linear``. Attention itself (the
softmax over the KV cache) is left out: its cost depends on the context
length, and leaving it out makes the layer shorter, so LoRA's share larger.

LoRA (rank 16) is on all seven projections, applied as vLLM's
``PunicaWrapperCPU.add_lora_linear`` does: per module, a zeroed fp32 buffer
[T, 16] per slice, one shrink per slice (scale 1.0) and one
``expand_slice`` per slice into the fused bf16 output (add_inputs=True);
decode uses the bgmv ops with a random adapter per token, prefill the sgmv
ops with one adapter per sequence. Four implementations of the ops:

* reference: ``vllm_cpu_lora.reference`` (vLLM's torch algorithm);
* grouped: pure torch, tokens grouped by adapter, one ``torch.mm`` per
  adapter (``benchmarks.baselines``);
* ours: ``vllm_cpu_lora.ops`` (the C++ kernels);
* fused: the C++ kernels as ``PunicaWrapperCPULoRA`` calls them, one
  ``lora_shrink`` and one ``lora_expand`` over all slices of a module (8
  calls a layer instead of 14; decode and prefill alike get each token's
  adapter).

Adapters are cold, as when serving many of them: the LoRA weights live in a
pool of distinct adapter slots larger than the L3 cache, and every LoRA
application uses slots the previous ones did not touch (see
``layer_model.LoraPool``);
the base weights rotate through three copies of the layer, as the layers of
a model follow each other. Timings are medians over interleaved rounds.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks import common, layer_report, machine, report, timing
from benchmarks.baselines import randn
from benchmarks.layer_model import (
    CHECK_RTOL,
    HIDDEN,
    IMPLS,
    MODULES,
    RANK,
    BaseLayer,
    Impl,
    LoraPool,
    layer_forward,
    lora_only,
    make_impls,
)
from benchmarks.report import GIB, MIB

_TOKENS = (1, 8, 32, 128)
_ADAPTERS = (1, 4, 15)
_PREFILL_TOKENS = 512
_PREFILL_SEGMENTS = 4
_FOUNDERS = (32, 15)  # (tokens, adapters) of the founders' note.

# Cold weights: the adapter pool and the base-layer copies each span at least
# this much memory (the VM reports a 480 MiB L3, probably the host's).
_ROTATION_BYTES = 5 << 28  # 1.25 GiB
_BASE_COPIES = 3

# ------------------------------------------------------------------ cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case: decode (bgmv) or prefill (sgmv)."""

    tokens: int
    adapters: int
    prefill: bool = False
    segments: int = 0  # Prefill only: sequences, one adapter each.

    @property
    def label(self) -> str:
        """The case's name in tables and plots."""
        if self.prefill:
            return f"prefill T{self.tokens} S{self.segments} L{self.adapters}"
        return f"decode T{self.tokens} L{self.adapters}"

    @property
    def founders(self) -> bool:
        """The founders' case: 32 decode tokens over 15 adapters."""
        return not self.prefill and (self.tokens, self.adapters) == _FOUNDERS


def build_cases(quick: bool) -> list[Case]:
    """The issue's cases, or the founders' case and one more with quick."""
    if quick:
        return [Case(*_FOUNDERS), Case(1, 1)]
    cases = [Case(t, n) for n in _ADAPTERS for t in _TOKENS]
    cases.append(
        Case(
            _PREFILL_TOKENS,
            _PREFILL_SEGMENTS,
            prefill=True,
            segments=_PREFILL_SEGMENTS,
        )
    )
    return cases


# ---------------------------------------------------------------- a case


@dataclasses.dataclass
class Prepared:
    """A case's inputs and the callables to time."""

    case: Case
    x: torch.Tensor
    used: int
    impls: dict[str, Impl]
    acts: dict[str, torch.Tensor]
    outs: dict[str, torch.Tensor]


def prepare(case: Case, base: BaseLayer, seed: int) -> Prepared:
    """A case's input, token mapping, implementations and activations."""
    gen = torch.Generator().manual_seed(seed)
    t = case.tokens
    x = randn(gen, t, HIDDEN)
    if case.prefill:
        seg = t // case.segments
        starts = torch.arange(case.segments) * seg
        lengths = torch.full((case.segments,), seg)
        lora_idx = torch.arange(case.segments) % case.adapters
        used = int(torch.unique(lora_idx).numel())
        meta = (starts, lengths, lora_idx, case.segments, seg, t)
        impls = make_impls(torch.empty(0, dtype=torch.long), meta)
    else:
        drawn = torch.randint(0, case.adapters, (t,), generator=gen)
        # Renumber: the adapters in use become 0..used-1 (see LoraPool).
        _, indices = torch.unique(drawn, sorted=True, return_inverse=True)
        used = int(indices.max()) + 1
        impls = make_impls(indices.long(), None)
    acts: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        layer_forward(base.copies[0], base.norms, x, acts=acts)
    outs = {
        name: torch.zeros(t, sum(slices), dtype=torch.bfloat16)
        for name, _, slices in MODULES
    }
    return Prepared(case, x, used, impls, acts, outs)


def check(prep: Prepared, base: BaseLayer, pool: LoraPool) -> dict[str, float]:
    """Layer outputs with grouped and ours against the reference's.

    Returns:
        Per implementation, max |out - reference out| / max |reference out
        - base out|.

    Raises:
        AssertionError: an implementation is beyond CHECK_RTOL.
    """
    weights = base.copies[0]
    views = pool.window(0, prep.case.adapters)
    plain = layer_forward(weights, base.norms, prep.x).float()
    got = {
        name: layer_forward(
            weights, base.norms, prep.x, (prep.impls[name], views)
        ).float()
        for name in IMPLS
    }
    want = got["reference"]
    delta = (want - plain).abs().max().item()
    errors = {}
    for name in IMPLS[1:]:
        err = (got[name] - want).abs().max().item()
        errors[name] = err / max(delta, 1e-30)
        if not errors[name] <= CHECK_RTOL:
            raise AssertionError(
                f"{name}: layer output differs from the reference's by "
                f"{err:.3g} (the reference's LoRA changed it by up to "
                f"{delta:.3g})"
            )
    return errors


def callables(
    prep: Prepared, base: BaseLayer, pool: LoraPool
) -> dict[str, tuple[Callable[[], None], bool]]:
    """name -> (call, is a whole layer); each call uses cold weights."""
    adapters, used, x = prep.case.adapters, prep.used, prep.x
    norms = base.norms
    calls: dict[str, tuple[Callable[[], None], bool]] = {
        "base": (lambda: layer_forward(base.next(), norms, x), True)
    }
    for name in IMPLS:
        impl = prep.impls[name]

        def with_lora(impl: Impl = impl) -> None:
            layer_forward(
                base.next(), norms, x, (impl, pool.next(adapters, used))
            )

        def alone(impl: Impl = impl) -> None:
            lora_only(impl, pool.next(adapters, used), prep.acts, prep.outs)

        calls[f"with_{name}"] = (with_lora, True)
        calls[f"alone_{name}"] = (alone, False)
    return calls


def run_case(
    case: Case,
    base: BaseLayer,
    pool: LoraPool,
    seed: int,
    budget_s: float,
    sample_s: float,
    quick: bool,
) -> dict[str, Any]:
    """Checks, then times one case with the current thread count."""
    started = time.perf_counter()
    prep = prepare(case, base, seed)
    errors = check(prep, base, pool)
    timed = timing.measure_rounds(
        callables(prep, base, pool),
        budget_s,
        sample_s,
        min_rounds=4 if quick else 5,
        max_rounds=60,
    )
    t_base = timed["base"]["median_s"]
    lora_bytes = prep.used * pool.slot_bytes
    lora_flops = 2 * case.tokens * pool.slot_bytes // 2
    result = {
        "label": case.label,
        **dataclasses.asdict(case),
        "founders_case": case.founders,
        "threads": torch.get_num_threads(),
        "adapters_used": prep.used,
        "base_bytes": base.bytes_per_copy,
        "lora_bytes": lora_bytes,
        "byte_floor": lora_bytes / base.bytes_per_copy,
        "lora_flops": lora_flops,
        "base_flops": 2 * case.tokens * base.bytes_per_copy // 2,
        "check_rel_error": errors,
        "timing": timed,
        "base_s": t_base,
        "base_iqr_rel": timed["base"]["iqr_s"] / t_base,
        "impls": {},
    }
    for name in IMPLS:
        t_with = timed[f"with_{name}"]["median_s"]
        t_alone = timed[f"alone_{name}"]["median_s"]
        result["impls"][name] = {
            "with_s": t_with,
            "alone_s": t_alone,
            "share": (t_with - t_base) / t_base,
            "share_alone": t_alone / t_base,
            "share_paired": statistics.median(
                w / b - 1
                for w, b in zip(
                    timed[f"with_{name}"]["samples_s"],
                    timed["base"]["samples_s"],
                    strict=True,
                )
            ),
            "lora_gb_s": lora_bytes / t_alone / 1e9,
            "lora_gflop_s": lora_flops / t_alone / 1e9,
        }
    result["elapsed_s"] = time.perf_counter() - started
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the layer benchmark; 1 if an implementation failed its check."""
    started = time.perf_counter()
    args, out_dir, all_threads, thread_counts = common.start(
        argv, __doc__.split("\n")[0], "two cases (smoke test)"
    )
    info = machine.describe_machine(all_threads)
    print(
        f"CPU: {info['cpu']}; torch {info['torch']}, threads "
        f"{thread_counts}, ISA path {info['isa_path']}"
    )
    if info["load_average_start"] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: load average {info['load_average_start']:.1f} on "
            f"{os.cpu_count()} CPUs: other work will skew the figures, the "
            "multi-threaded ones most"
        )

    gen = torch.Generator().manual_seed(0)
    base = BaseLayer(_BASE_COPIES, gen)
    pool = LoraPool(_ROTATION_BYTES, gen)
    setup = {
        "base_bytes": base.bytes_per_copy,
        "base_copies": _BASE_COPIES,
        "pool_slots": pool.slots,
        "pool_bytes": pool.bytes,
        "slot_bytes": pool.slot_bytes,
        "rank": RANK,
    }
    print(
        f"base layer {base.bytes_per_copy / MIB:.0f} MiB x {_BASE_COPIES} "
        f"copies; adapter pool {pool.slots} slots x "
        f"{pool.slot_bytes / MIB:.2f} MiB = {pool.bytes / GIB:.2f} GiB "
        f"(set up in {time.perf_counter() - started:.0f} s)"
    )
    cases = build_cases(args.quick)
    budget_s = 3.0 if args.quick else 5.0
    sample_s = 5e-3
    runs = [(t, i, c) for t in thread_counts for i, c in enumerate(cases)]
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    pct = report.pct
    try:
        with torch.no_grad():
            for threads, i, case in common.progress(runs, "layer"):
                torch.set_num_threads(threads)
                try:
                    res = run_case(
                        case, base, pool, i, budget_s, sample_s, args.quick
                    )
                except AssertionError as exc:  # Never time a wrong kernel.
                    failures.append(f"{case.label} ({threads} thr): {exc}")
                    common.say(f"  {case.label}: CHECK FAILED: {exc}")
                    continue
                results.append(res)
                imp = res["impls"]
                common.say(
                    f"  [{threads} thr] {case.label:<22} base "
                    f"{1e3 * res['base_s']:6.1f} ms  share: "
                    + "  ".join(f"{n} {pct(imp[n]['share'])}" for n in IMPLS)
                    + f"  (ours alone {pct(imp['ours']['share_alone'])})"
                )
    finally:
        torch.set_num_threads(all_threads)

    info["load_average_end"] = machine.load_average()
    setup["elapsed_s"] = time.perf_counter() - started
    layer_report.finish(info, setup, results, failures, args.quick, out_dir)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
