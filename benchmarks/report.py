"""Writing results: number formats, tables, target lines, JSON and plots."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

MIB = 1 << 20
GIB = 1 << 30

# Colour of each op in the plots.
OP_COLORS = {
    "bgmv_shrink": "C0",
    "bgmv_expand": "C1",
    "sgmv_shrink": "C2",
    "sgmv_expand": "C3",
}

# (name, passed: True / False / None for not applicable, detail)
Target = tuple[str, bool | None, str]


def num(value: float) -> str:
    """A figure with 3 significant digits, or whole from 100 up."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def pct(value: float) -> str:
    """A fraction as a percentage with one decimal."""
    return f"{100 * value:.1f}%"


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of the positive finite values (NaN if none)."""
    values = [v for v in values if v > 0 and math.isfinite(v)]
    if not values:
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def table(
    head: Sequence[str],
    rows: Sequence[Sequence[str]],
    markdown: bool,
    left: int = 1,
    align_right: bool = False,
) -> list[str]:
    """A table in markdown, or as aligned text for the terminal.

    Args:
        head: the column titles.
        rows: the cells, row by row.
        markdown: markdown, else aligned text.
        left: the text column aligned left (the others align right).
        align_right: markdown: every column after the first right-aligned.
    """
    if markdown:
        rule = (
            "|---|" + "---:|" * (len(head) - 1)
            if align_right
            else "|" + "---|" * len(head)
        )
        lines = ["| " + " | ".join(head) + " |", rule]
        return lines + ["| " + " | ".join(row) + " |" for row in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = "  ".join(
        f"{{:<{w}}}" if i == left else f"{{:>{w}}}"
        for i, w in enumerate(widths)
    )
    return [fmt.format(*head)] + [fmt.format(*row) for row in rows]


def summary_table(
    per_threads: dict[str, dict[str, Any]],
    fmt: Callable[[float], str] = num,
) -> list[str]:
    """Markdown table of figures (rows) per thread count (columns).

    Floats are formatted with fmt, other values with str.
    """
    keys = sorted(per_threads, key=int, reverse=True)
    lines = ["| figure | " + " | ".join(f"{k} thr" for k in keys) + " |"]
    lines.append("|---|" + "---|" * len(keys))
    for key in next(iter(per_threads.values()), {}):
        vals = []
        for k in keys:
            v = per_threads[k][key]
            vals.append(fmt(v) if isinstance(v, float) else str(v))
        lines.append(f"| {key} | " + " | ".join(vals) + " |")
    return lines


def target_lines(targets: Iterable[Target]) -> list[str]:
    """PASS / FAIL / N/A lines, one per target."""
    lines = []
    for name, ok, detail in targets:
        status = "N/A " if ok is None else ("PASS" if ok else "FAIL")
        lines.append(f"{status}  {name}: {detail}")
    return lines


def target_block(
    targets: Iterable[Target], failures: Iterable[str]
) -> list[str]:
    """The target lines and correctness failures, fenced, for markdown."""
    return [
        "```",
        *target_lines(targets),
        *(f"FAIL  correctness: {f}" for f in failures),
        "```",
        "",
    ]


def targets_json(targets: Iterable[Target]) -> list[dict[str, Any]]:
    """The targets as JSON objects."""
    return [{"name": n, "pass": ok, "detail": d} for n, ok, d in targets]


def cpu_lines(
    m: dict[str, Any],
    threads: bool = True,
    caches: bool = True,
    supported: bool = False,
) -> list[str]:
    """Markdown bullets: the CPU, its flags, caches, torch and ISA path."""
    cpu = f"- CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs"
    cpu += f"; torch uses {m['threads_all']} threads)" if threads else ")"
    lines = [cpu, f"- Flags: {' '.join(m['flags'])}"]
    if caches:
        lines.append(
            "- Caches per instance (sysfs; a VM may report its host's): "
            + ", ".join(
                f"{k} {v / MIB:g} MiB"
                for k, v in m["caches_per_instance"].items()
            )
        )
    software = (
        f"- torch {m['torch']}, Python {m['python']}; vllm_cpu_lora ISA "
        f"path `{m['isa_path']}`"
    )
    if supported:
        software += f" (supported: {', '.join(m['supported_isas'])})"
    if "torch_isa" in m:
        software += (
            f"; torch's own kernels: ATen `{m['torch_isa']}`, oneDNN "
            f"{m['onednn_max_isa']}"
        )
    lines.append(software)
    if "allocator" in m:
        lines.append(f"- Allocator: {m['allocator']}")
    return lines


def write_json(path: pathlib.Path, obj: Any) -> None:
    """Writes obj as indented JSON (NaN allowed; the unknown as str)."""
    path.write_text(json.dumps(obj, indent=1, allow_nan=True, default=str))


def write_markdown(path: pathlib.Path, lines: Iterable[str]) -> None:
    """Writes the lines of a markdown report."""
    pathlib.Path(path).write_text("\n".join(lines))


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: pathlib.Path, dpi: int = 130) -> None:
    """Saves a figure (tight layout) and closes it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
