"""What the benchmark parts share: where results go, where builds go."""

from __future__ import annotations

import os
import pathlib


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
