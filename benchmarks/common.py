"""What the benchmark parts share: where results go, progress output, and
the command line of the parts that time both thread counts.

``python -m benchmarks.common [--quick]`` prints the default results folder
(scripts/bench_ipex.sh asks it, so that the rule lives in one place); it
needs only the standard library.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Iterable, Sequence
from typing import TypeVar

from benchmarks import allocator, machine

_T = TypeVar("_T")


def default_out_dir(quick: bool = False) -> pathlib.Path:
    """benchmarks/results/<cpu slug> of the checkout run from.

    Outside a checkout, ./bench-results/<cpu slug>. Each CPU has its own
    folder (``machine.cpu_slug``), so that one machine's run never replaces
    another's; ``--quick`` runs go to a ``quick`` subfolder of it, so that
    they never replace the full results the README links.
    """
    repo_results = pathlib.Path.cwd() / "benchmarks" / "results"
    base = (
        repo_results
        if repo_results.parent.is_dir()
        else (pathlib.Path.cwd() / "bench-results")
    )
    base /= machine.cpu_slug()
    return base / "quick" if quick else base


def progress(items: Iterable[_T], desc: str) -> Iterable[_T]:
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


def out_argument(parser: argparse.ArgumentParser) -> None:
    """Adds --out DIR (default: default_out_dir)."""
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="output folder (default benchmarks/results/<cpu slug>, with "
        "--quick its quick subfolder)",
    )


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
    out_argument(parser)
    return parser.parse_args(argv)


def out_dir(args: argparse.Namespace) -> pathlib.Path:
    """The output folder --out / --quick ask for, created."""
    path = args.out or default_out_dir(args.quick)
    path.mkdir(parents=True, exist_ok=True)
    return path


def start(
    argv: Sequence[str] | None, description: str, quick_help: str
) -> tuple[argparse.Namespace, pathlib.Path, int, list[int]]:
    """A part's start: its arguments, output folder, and thread counts.

    Also sets the process's allocator (allocator.keep_freed_memory).

    Returns:
        The parsed arguments, the output folder (created), torch's thread
        count (all threads) and the thread counts --threads asks for.
    """
    import torch

    args = parse_args(argv, description, quick_help)
    allocator.keep_freed_memory()
    all_threads = torch.get_num_threads()
    return (
        args,
        out_dir(args),
        all_threads,
        thread_counts(args.threads, all_threads),
    )


def thread_counts(choice: str, all_threads: int) -> list[int]:
    """The thread counts --threads both|all|1 asks for, without repeats."""
    counts = {"both": [all_threads, 1], "all": [all_threads], "1": [1]}
    return list(dict.fromkeys(counts[choice]))


if __name__ == "__main__":
    print(default_out_dir("--quick" in sys.argv[1:]))
