"""How the benchmarks time calls: loops of calls, and interleaved rounds.

Implementations are compared by ratios of medians measured side by side:
each round takes one sample of every callable, the order rotating from
round to round, with the garbage collector off, so that a slow moment of a
shared machine falls on all of them alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def time_calls(fn: Callable[[], object], count: int) -> float:
    """Seconds per call of `count` calls of fn in a loop."""
    start = time.perf_counter_ns()
    for _ in range(count):
        fn()
    return (time.perf_counter_ns() - start) / count * 1e-9


def median_time(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """Median over `repeats` samples of seconds per call (`inner` a loop)."""
    return statistics.median(time_calls(fn, inner) for _ in range(repeats))


def interleave(
    samplers: dict[str, Callable[[], float]],
    done: Callable[[int, float], bool],
) -> dict[str, list[float]]:
    """Samples every sampler once a round, the order rotating.

    Args:
        samplers: name -> a function that takes one sample (seconds).
        done: done(rounds so far, seconds since the start) ends the rounds.

    Returns:
        Per name, its samples in round order.
    """
    names = list(samplers)
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        rounds = 0
        while True:
            shift = rounds % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(samplers[name]())
            rounds += 1
            if done(rounds, time.perf_counter() - start):
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def _rounds_done(
    budget_s: float, min_rounds: int, slow_min_rounds: int, max_rounds: int
) -> Callable[[int, float], bool]:
    """interleave's done: budget_s spent once min_rounds are, or max_rounds.

    min_rounds drops to slow_min_rounds when the first round alone took a
    quarter of the budget.
    """
    least = min_rounds

    def done(rounds: int, elapsed: float) -> bool:
        nonlocal least
        if rounds == 1 and elapsed > budget_s / 4:
            least = slow_min_rounds
        return rounds >= max_rounds or (rounds >= least and elapsed >= budget_s)

    return done


def measure_interleaved(
    calls: dict[str, Callable[[], None]],
    budget_s: float,
    sample_s: float,
    max_rounds: int = 200,
    first_call_s: dict[str, float] | None = None,
) -> dict[str, dict[str, Any]]:
    """Median seconds per call of each callable, measured round-robin.

    measure_spread of one case in one pass; see there.
    """
    first = [first_call_s] if first_call_s else None
    return measure_spread([calls], 1, budget_s, sample_s, max_rounds, first)[0]


def measure_spread(
    cases: Sequence[dict[str, Callable[[], None]]],
    passes: int,
    budget_s: float,
    sample_s: float,
    max_rounds: int = 200,
    first_call_s: Sequence[dict[str, float]] | None = None,
    settle_s: float = 5e-3,
) -> list[dict[str, dict[str, Any]]]:
    """Median seconds per call of each case's callables, in spread rounds.

    Within a case, each round takes one sample of every callable (the order
    rotates from round to round); a sample is a loop of calls lasting about
    sample_s, preceded by untimed calls of the same callable for at least
    settle_s (one at least), so that it is timed in its own steady state:
    its working set hot, and what the previous callable left behind gone (a
    reference call writes tens of MB, whose write-backs slow whatever runs
    in the next few milliseconds).

    The rounds of a case are spread over `passes` passes through all cases,
    each pass spending budget_s / passes on it: a slow spell of a shared
    machine (seconds long) then falls on one pass of many cases rather than
    on every round of a few. A case takes at least 7 rounds in all (3 when
    one round alone takes a good part of its pass).

    Args:
        cases: per case, its callables, already called once (warm).
        passes: passes through all cases.
        budget_s: time to spend on a case's rounds once its minimum is done.
        sample_s: duration of one sample.
        max_rounds: the most rounds of a case.
        first_call_s: per case, how long each first call took; a callable
            slower than 50 ms is sized from it instead of a second warm-up
            call.
        settle_s: least duration of the untimed calls before a sample.

    Returns:
        Per case, per callable: median_s, rounds, calls_per_sample.
    """
    inner: list[dict[str, int]] = []
    for i, calls in enumerate(cases):
        first = first_call_s[i] if first_call_s else {}
        inner.append({})
        for name, fn in calls.items():
            once = first.get(name, 0.0)
            if once < 0.05:
                once = time_calls(fn, 1)  # Second warm-up, and a size.
            inner[i][name] = max(1, min(100_000, int(sample_s / once)))

    def sampler(fn: Callable[[], None], count: int) -> Callable[[], float]:
        def sample() -> float:
            settle = time.perf_counter() + settle_s
            fn()
            while time.perf_counter() < settle:
                fn()
            return time_calls(fn, count)

        return sample

    samples: list[dict[str, list[float]]] = [
        {name: [] for name in calls} for calls in cases
    ]
    for _ in range(passes):
        for i, calls in enumerate(cases):
            done = _rounds_done(
                budget_s / passes,
                -(-7 // passes),  # Ceiling division.
                -(-3 // passes),
                max(1, max_rounds // passes),
            )
            taken = interleave(
                {n: sampler(fn, inner[i][n]) for n, fn in calls.items()}, done
            )
            for name, values in taken.items():
                samples[i][name] += values
    return [
        {
            name: {
                "median_s": statistics.median(values),
                "rounds": len(values),
                "calls_per_sample": inner[i][name],
            }
            for name, values in case_samples.items()
        }
        for i, case_samples in enumerate(samples)
    ]


def measure_rounds(
    calls: dict[str, tuple[Callable[[], None], bool]],
    budget_s: float,
    sample_s: float,
    min_rounds: int,
    max_rounds: int,
) -> dict[str, dict[str, Any]]:
    """Median seconds per call of slow callables, in interleaved rounds.

    One warm-up round is discarded. A sample of a callable marked whole is
    one call; of the others, a loop of calls lasting about sample_s. Rounds
    stop after budget_s once min_rounds are done, or after 2.5 times
    budget_s once 3 are (the slow reference cases).

    Args:
        calls: name -> (callable, whether one call is a whole sample).
        budget_s: time to spend on rounds once min_rounds are done.
        sample_s: duration of a sample of the callables not marked whole.
        min_rounds: the least measured rounds before budget_s ends them.
        max_rounds: the most measured rounds.

    Returns:
        Per callable: median_s, iqr_s, min_s, rounds, calls_per_sample and
        samples_s (every measured sample, in round order).
    """
    count = {}
    for name, (fn, whole) in calls.items():
        once = time_calls(fn, 1)  # Warm-up, and a size.
        count[name] = 1 if whole else max(1, min(1000, int(sample_s / once)))

    def done(rounds: int, elapsed: float) -> bool:
        return (
            rounds > max_rounds
            or (rounds > min_rounds and elapsed >= budget_s)
            or (rounds > 3 and elapsed >= 2.5 * budget_s)
        )

    samples = interleave(
        {
            name: (lambda fn=fn, n=count[name]: time_calls(fn, n))
            for name, (fn, _) in calls.items()
        },
        done,
    )
    out = {}
    for name, taken in samples.items():
        values = taken[1:]  # Round 0 is the warm-up.
        q1, _, q3 = statistics.quantiles(values, n=4)
        out[name] = {
            "median_s": statistics.median(values),
            "iqr_s": q3 - q1,
            "min_s": min(values),
            "rounds": len(values),
            "calls_per_sample": count[name],
            "samples_s": values,
        }
    return out
