"""The kernel benchmark's #16 targets and its 'at the bound' figure."""

import math

from benchmarks import kernels_targets


def row(
    label,
    ours_us,
    bound_us,
    reference_us=100.0,
    grouped_us=10.0,
    op="bgmv_expand",
    tokens=1,
    dtype="bf16",
):
    return {
        "label": label,
        "op": op,
        "family": op.split("_")[0],
        "tokens": tokens,
        "dtype": dtype,
        "bound_s": bound_us * 1e-6,
        "median_s": {"ours": ours_us * 1e-6, "reference": reference_us * 1e-6},
        "fraction_of_bound": bound_us / ours_us,
        "speedup_vs_grouped": grouped_us / ours_us,
    }


def test_vs_reference_at_bound_takes_ours_where_it_beats_the_bound():
    rows = [
        row("a", ours_us=4.0, bound_us=1.0),  # 100 us / 1 us
        row("b", ours_us=2.0, bound_us=8.0),  # 100 us / 2 us: beats its bound
    ]
    assert math.isclose(
        kernels_targets.vs_reference_at_bound(rows), math.sqrt(100 * 50)
    )


def test_targets_count_cases_and_those_the_fixed_cost_decides():
    rows = [
        # 10% of its bound; 1 us fixed cost + 0.15 > 5 x 0.15 us: the call's.
        row("tiny", ours_us=1.5, bound_us=0.15),
        # 20%, beyond 3x but 1 + 0.8 us < 3 x 0.8 us: the loop's doing.
        row("slow", ours_us=4.0, bound_us=0.8),
        # 50%: within both.
        row("fine", ours_us=2.0, bound_us=1.0, tokens=8),
        # fp16 is outside #16's targets.
        row("fp16", ours_us=100.0, bound_us=1.0, dtype="fp16"),
        row(
            "prefill", ours_us=10.0, bound_us=9.0, op="sgmv_shrink", tokens=2048
        ),
    ]
    summary = {
        "bgmv_fraction_of_bound": 0.49,
        "sgmv_fraction_of_bf16_peak": 0.71,
        "fixed_cost_us": 1.0,
    }
    got = {
        name: (ok, detail)
        for name, ok, detail in kernels_targets.issue16_targets(
            "[1 thread]", rows, summary, "fp32 FMA"
        )
    }
    slower = got["[1 thread] bf16 and fp32 cases slower than grouped torch"]
    assert slower == (True, "0 of 4; the slowest prefill 1.00x")
    assert (
        got["[1 thread] decode geomean fraction of the in-cache bound"][0]
        is False
    )
    floor = got[
        "[1 thread] bf16 and fp32 decode cases below 20% of their bound"
    ]
    assert floor[0] is False
    assert floor[1].startswith("1 of 3, 1 of them held there by the B=1")
    assert "the lowest tiny 10.0%" in floor[1]
    one_token = got[
        "[1 thread] bf16 and fp32 one-token expands beyond 3x their bound"
    ]
    assert one_token[0] is False
    assert one_token[1].startswith("2 of 2, 1 of them held there by the B=1")
    assert (
        got["[1 thread] prefill geomean fraction of the fp32 FMA peak"][0]
        is True
    )


def test_slower_than_grouped_fails():
    rows = [row("lost", ours_us=2.0, bound_us=1.0, grouped_us=1.5)]
    summary = {
        "bgmv_fraction_of_bound": 0.5,
        "sgmv_fraction_of_bf16_peak": math.nan,
        "fixed_cost_us": 0.1,
    }
    got = {
        name: (ok, detail)
        for name, ok, detail in kernels_targets.issue16_targets(
            "[2 threads]", rows, summary, "vdpbf16ps"
        )
    }
    assert got["[2 threads] bf16 and fp32 cases slower than grouped torch"] == (
        False,
        "1 of 1; the slowest lost 0.75x",
    )
    prefill = got["[2 threads] prefill geomean fraction of the vdpbf16ps peak"]
    assert prefill == (None, "no cases")
