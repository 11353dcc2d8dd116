"""What the benchmark parts share: where results go, where builds go, the
command line of the parts that time both thread counts."""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Sequence


def default_out_dir(quick: bool = False) -> pathlib.Path:
    """benchmarks/results of the checkout run from, else ./bench-results.

    ``--quick`` runs go to a ``quick`` subfolder so that they never replace
    the full results the README links.
    """
    repo_results = pathlib.Path.cwd() / "benchmarks" / "results"
    base = (
        repo_results
        if repo_results.parent.is_dir()
        else (pathlib.Path.cwd() / "bench-results")
    )
    return base / "quick" if quick else base


def build_dir(name: str) -> pathlib.Path:
    """A cache folder for code compiled at run time (outside the package)."""
    root = pathlib.Path(
        os.environ.get("VLLM_CPU_LORA_CACHE")
        or pathlib.Path.home() / ".cache" / "vllm-cpu-lora"
    )
    path = root / "bench-build" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def progress(items, desc: str):
    """items wrapped in a tqdm progress bar (on stderr), if tqdm is there."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="case", dynamic_ncols=True)


def say(text: str) -> None:
    """Prints a line without breaking a progress bar."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(text, flush=True)
    else:
        tqdm.write(text)


def parse_args(
    argv: Sequence[str] | None, description: str, quick_help: str
) -> argparse.Namespace:
    """--quick, --threads both|all|1 and --out, shared by the parts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument(
        "--threads",
        choices=("both", "all", "1"),
        default="both",
        help="all threads (torch.get_num_threads()), 1, or both (default)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="output folder (default benchmarks/results, with --quick "
        "benchmarks/results/quick)",
    )
    return parser.parse_args(argv)


def thread_counts(choice: str, all_threads: int) -> list[int]:
    """The thread counts --threads both|all|1 asks for, without repeats."""
    counts = {"both": [all_threads, 1], "all": [all_threads], "1": [1]}
    return list(dict.fromkeys(counts[choice]))


def load_average() -> float:
    """1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")
