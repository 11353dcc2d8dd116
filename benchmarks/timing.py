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
from collections.abc import Callable
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


def measure_interleaved(
    calls: dict[str, Callable[[], None]],
    budget_s: float,
    sample_s: float,
    max_rounds: int = 200,
    first_call_s: dict[str, float] | None = None,
    settle_s: float = 5e-3,
) -> dict[str, dict[str, Any]]:
    """Median seconds per call of each callable, measured round-robin.

    Each round takes one sample of every callable (the order rotates from
    round to round); a sample is a loop of calls lasting about sample_s,
    preceded by untimed calls of the same callable for at least settle_s
    (one at least), so that it is timed in its own steady state: its
    working set hot, and what the previous callable left behind gone (a
    reference call writes tens of MB, whose write-backs slow whatever runs
    in the next few milliseconds). Rounds stop once budget_s is spent (at
    least 7 rounds, 3 when one round alone takes a good part of the budget).

    Args:
        calls: the callables, already called once (warm).
        budget_s: time to spend on rounds once the minimum is reached.
        sample_s: duration of one sample.
        max_rounds: the most rounds.
        first_call_s: how long a first call took; a callable slower than
            50 ms is sized from it instead of a second warm-up call.
        settle_s: least duration of the untimed calls before a sample.

    Returns:
        Per callable: median_s, rounds, calls_per_sample.
    """
    first_call_s = first_call_s or {}
    inner = {}
    for name, fn in calls.items():
        once = first_call_s.get(name, 0.0)
        if once < 0.05:
            once = time_calls(fn, 1)  # Second warm-up, and a size.
        inner[name] = max(1, min(100_000, int(sample_s / once)))

    def sampler(name: str) -> Callable[[], float]:
        def sample() -> float:
            fn = calls[name]
            settle = time.perf_counter() + settle_s
            fn()
            while time.perf_counter() < settle:
                fn()
            return time_calls(fn, inner[name])

        return sample

    min_rounds = 7

    def done(rounds: int, elapsed: float) -> bool:
        nonlocal min_rounds
        if rounds == 1 and elapsed > budget_s / 4:
            min_rounds = 3
        return rounds >= max_rounds or (
            rounds >= min_rounds and elapsed >= budget_s
        )

    samples = interleave({name: sampler(name) for name in calls}, done)
    return {
        name: {
            "median_s": statistics.median(samples[name]),
            "rounds": len(samples[name]),
            "calls_per_sample": inner[name],
        }
        for name in calls
    }


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
