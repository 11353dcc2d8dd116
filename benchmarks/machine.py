"""The machine a benchmark runs on: what it is, and its measured limits.

The CPU's model, flags and caches (from /proc/cpuinfo and sysfs), a
filesystem-safe name for it (``cpu_slug``, the results folder), and the
read bandwidth and compute peaks that the kernel benchmark's bound uses,
measured by the micro-kernels of ``micro/micro_kernels.cpp``: AVX-512 or
AVX2 loads for read bandwidth, a register loop of ``vfmadd231ps`` (and of
``vdpbf16ps`` where the CPU has AVX512-BF16) and AMX ``tdpbf16ps`` where
present for peak, each chosen by the CPU's flags.

Only the standard library is imported at the top, so that a shell script
can ask for the results folder (``common.default_out_dir``) without torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import pathlib
import platform
import re
import subprocess
import time
from collections.abc import Callable
from typing import Any

from benchmarks import allocator

_MIB = 1 << 20
_GIB = 1 << 30
_CPUINFO = pathlib.Path("/proc/cpuinfo")
_MICRO_SRC = pathlib.Path(__file__).resolve().parent / "micro"
_CSRC_CPU = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "cpu"

# The peaks each ISA path of vllm_cpu_lora can use (Limits attributes). bf16
# is widened to fp32 on the paths without bf16 dot products, so their peak
# is the fp32 FMA peak; the scalar path is bounded by it too.
_PATH_PEAKS = {
    "amx": ("amx_bf16_peak", "bf16_dot_peak", "fp32_fma_peak"),
    "amx_emulated": ("bf16_dot_peak", "fp32_fma_peak"),
    "avx512_bf16": ("bf16_dot_peak", "fp32_fma_peak"),
    "avx512": ("fp32_fma_peak",),
    "avx2": ("fp32_fma_peak",),
    "scalar": ("fp32_fma_peak",),
}
_PEAK_NAMES = {
    "amx_bf16_peak": "AMX tdpbf16ps",
    "bf16_dot_peak": "vdpbf16ps",
    "fp32_fma_peak": "fp32 FMA",
}

# AMD family -> ((first model, last model, name), ...): the VMs report
# "AMD EPYC" only, so the generation comes from family and model.
_AMD_GENERATIONS = {
    0x17: ((0x00, 0x2F, "zen"), (0x30, 0xFF, "zen2")),
    0x19: (
        (0x00, 0x0F, "zen3"),
        (0x10, 0x1F, "zen4"),
        (0x20, 0x5F, "zen3"),
        (0x60, 0xAF, "zen4"),
    ),
    0x1A: ((0x00, 0xFF, "zen5"),),
}


# ------------------------------------------------------------------ the CPU


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where none)."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> set[str]:
    """The CPU's feature flags, as /proc/cpuinfo names them."""
    return set(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name."""
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def best_isa(flags: set[str]) -> str:
    """The widest vector ISA the flags offer, as vllm_cpu_lora names paths."""
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        return "amx"
    if {"avx512f", "avx512_bf16"} <= flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return platform.machine().lower() or "scalar"


def micro_isa(flags: set[str], isa_path: str = "") -> str | None:
    """The micro-kernels' load and FMA variant for these flags (None: none),
    no wider than the ISA path in use: a path forced on a wider CPU
    (VLLM_CPU_LORA_ISA=avx2 on AVX-512) is bound by what it can use."""
    if "avx512f" in flags and isa_path != "avx2":
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def _amd_generation(info: dict[str, str]) -> str | None:
    if info.get("vendor_id") != "AuthenticAMD":
        return None
    try:
        family, model = int(info["cpu family"]), int(info["model"])
    except (KeyError, ValueError):
        return None
    for first, last, name in _AMD_GENERATIONS.get(family, ()):
        if first <= model <= last:
            return name
    return None


def cpu_slug() -> str:
    """A stable, filesystem-safe name for this CPU, e.g. amd-epyc-zen3-avx2.

    The model name without trademarks, "Processor", "CPU", core counts and
    clock, then the AMD generation (VMs often hide the model number) and the
    widest vector ISA, so that different CPUs never share a results folder.
    """
    name = cpu_model().lower()
    name = re.sub(
        r"\((r|tm)\)|@.*$|\b\d+-core\b|\bprocessor\b|\bcpu\b", " ", name
    )
    words = re.sub(r"[^a-z0-9]+", " ", name).split()
    generation = _amd_generation(_cpuinfo())
    if generation and generation not in words:
        words.append(generation)
    words.append(best_isa(cpu_flags()).replace("_", ""))
    return "-".join(words)[:80].strip("-")


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def cache_sizes() -> dict[int, int]:
    """Data/unified cache size per level, per instance, from sysfs."""
    sizes: dict[int, int] = {}
    base = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            if kind == "Instruction":
                continue
            level = int((index / "level").read_text())
            sizes[level] = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return sizes


def load_average() -> float:
    """1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def busiest_processes(count: int = 6) -> list[str]:
    """The busiest processes by `ps` (nice, %CPU, RSS KiB, command): on a
    shared machine, who else ran; [] where there is no ps."""
    try:
        out = subprocess.run(
            ["ps", "-eo", "ni,pcpu,rss,comm", "--sort=-pcpu", "--no-headers"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [" ".join(line.split()) for line in out.splitlines()[:count]]


def describe_machine(all_threads: int) -> dict[str, Any]:
    """CPU model, relevant ISA flags, caches, threads, versions, date."""
    import torch

    import vllm_cpu_lora

    wanted = sorted(
        f
        for f in cpu_flags()
        if f.startswith(("avx512", "amx"))
        or f in ("avx2", "fma", "f16c", "avx_vnni", "hypervisor")
    )
    caches = cache_sizes()
    return {
        "cpu": cpu_model(),
        "cpu_slug": cpu_slug(),
        "flags": wanted,
        "logical_cpus": os.cpu_count(),
        "threads_all": all_threads,
        "caches_per_instance": {f"L{k}": v for k, v in sorted(caches.items())},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "isa_path": vllm_cpu_lora.isa(),
        # What torch's own kernels (the baselines) may use: ATen's vector
        # ISA (ATEN_CPU_CAPABILITY) and oneDNN's limit (ONEDNN_MAX_CPU_ISA).
        "torch_isa": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "unlimited"),
        "supported_isas": vllm_cpu_lora.supported_isas(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "load_average_start": load_average(),
        "allocator": allocator.state(),
    }


# ------------------------------------------------------------------ limits


@dataclasses.dataclass
class Limits:
    """Measured machine limits for one thread count (bytes/s, flop/s)."""

    threads: int
    isa: str  # The micro-kernels' variant (avx512, avx2; "" if none ran).
    l2_read: float
    l3_read: float
    dram_read: float
    bf16_dot_peak: float
    fp32_fma_peak: float
    amx_bf16_peak: float
    l2_bytes: int  # Aggregate L2 of `threads` cores.
    l3_bytes: int
    l2_buffer: int
    l3_buffer: int
    dram_buffer: int

    def bandwidth_for(self, working_set: int) -> tuple[float, str]:
        """In-cache read bandwidth for a working set of this size."""
        if working_set <= self.l2_bytes * 3 // 4:
            return self.l2_read, "L2"
        if working_set <= self.l3_bytes // 2:
            return self.l3_read, "L3"
        return self.dram_read, "DRAM"

    def peak_for(
        self, isa_path: str, bf16_weights: bool = True
    ) -> tuple[float, str]:
        """The compute peak that bounds a kernel on vllm_cpu_lora's path.

        The largest of the peaks of the instructions the path can use for
        the weights: with bf16 weights any of them (bf16 widens exactly to
        fp32); with fp32 weights only fp32 FMA, since vdpbf16ps and AMX
        would round them to bf16. An unknown path may use any.

        Returns:
            The peak (flop/s; NaN if none was measured) and its name.
        """
        attrs = (
            _PATH_PEAKS.get(isa_path, tuple(_PEAK_NAMES))
            if bf16_weights
            else ("fp32_fma_peak",)
        )
        peaks = [
            (getattr(self, a), a)
            for a in attrs
            if math.isfinite(getattr(self, a))
        ]
        if not peaks:
            return math.nan, "no peak measured"
        value, attr = max(peaks)
        return value, _PEAK_NAMES[attr]

    def bf16_peak(self, isa_path: str) -> tuple[float, str]:
        """The bf16 vector peak of vllm_cpu_lora's path: vdpbf16ps where the
        path uses it and it was measured, else fp32 FMA (bf16 widened)."""
        attrs = _PATH_PEAKS.get(isa_path, tuple(_PEAK_NAMES))
        if "bf16_dot_peak" in attrs and math.isfinite(self.bf16_dot_peak):
            return self.bf16_dot_peak, "vdpbf16ps"
        return self.fp32_fma_peak, "fp32 FMA"


def build_dir(name: str) -> pathlib.Path:
    """A cache folder for code compiled at run time (outside the package)."""
    root = pathlib.Path(
        os.environ.get("VLLM_CPU_LORA_CACHE")
        or pathlib.Path.home() / ".cache" / "vllm-cpu-lora"
    )
    path = root / "bench-build" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_micro_kernels() -> Any:
    """Compiles (once; cached in build_dir("micro")) the micro-kernels; None
    where they have no variant to run (they are x86 code, e.g. on Arm)."""
    if micro_isa(cpu_flags()) is None:
        return None
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name="bench_ops_micro",
        sources=[str(_MICRO_SRC / "micro_kernels.cpp")],
        extra_include_paths=[str(_CSRC_CPU)],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir("micro")),
        verbose=False,
    )


def _best_rate(
    fn: Callable[[int, int], float],
    threads: int,
    split: bool,
    quick: bool,
    target_s: float,
) -> float:
    """Best of several runs of fn(n, threads) (a rate), each about target_s.

    n is sized on one thread, which no late-woken thread can delay (on a
    busy machine a parallel call of any size can wait milliseconds for its
    second thread); with `split` the threads share the work of one n, so n
    is scaled by the thread count.
    """
    n = 1
    while True:
        start = time.perf_counter()
        fn(n, 1)
        elapsed = time.perf_counter() - start
        if elapsed >= target_s / 4:
            break
        n *= 4 if elapsed < target_s / 64 else 2
    n = max(1, int(n * target_s / elapsed)) * (threads if split else 1)
    return max(fn(n, threads) for _ in range(3 if quick else 7))


def measure_limits(micro: Any, threads: int, quick: bool) -> Limits:
    """Measures read bandwidth (L2, L3, DRAM) and peaks with `threads`."""
    import torch

    flags = cpu_flags()
    caches = cache_sizes()
    l2_core = caches.get(2, 1 * _MIB)
    l3 = caches.get(3, 32 * _MIB)
    l2_buffer = l2_core // 2 * threads
    l3_buffer = min(max(16 * _MIB, 4 * l2_core * threads), l3 // 2)
    dram_buffer = max(_GIB, 4 * l3)
    sizes = (l2_core * threads, l3, l2_buffer, l3_buffer, dram_buffer)
    target = 0.03 if quick else 0.08
    nan = math.nan
    import vllm_cpu_lora

    isa = micro_isa(flags, vllm_cpu_lora.isa())
    if isa is None:
        print("warning: no AVX2 or AVX-512: machine limits not measured")
        return Limits(threads, "", nan, nan, nan, nan, nan, nan, *sizes)

    def rate(fn: Callable[[int, int], float], split: bool = False) -> float:
        return _best_rate(fn, threads, split, quick, target)

    def bandwidth(nbytes: int) -> float:
        buf = torch.ones(nbytes, dtype=torch.uint8)  # Touch every page.
        micro.read_bandwidth(buf, 2, threads, isa)
        return rate(lambda n, t: micro.read_bandwidth(buf, n, t, isa), True)

    l2_read = bandwidth(l2_buffer)
    l3_read = bandwidth(l3_buffer)
    buf = torch.ones(dram_buffer, dtype=torch.uint8)
    dram_read = max(
        micro.read_bandwidth(buf, 1, threads, isa)
        for _ in range(2 if quick else 4)
    )
    del buf
    bf16 = nan
    if "avx512_bf16" in flags:
        bf16 = rate(lambda n, t: micro.bf16_dot_peak(n, t, 1e-3))
    fp32 = rate(lambda n, t: micro.fp32_fma_peak(n, t, 1e-3, isa))
    amx = nan
    if {"amx_tile", "amx_bf16"} <= flags and micro.amx_bf16_peak(1, 1, 1e-3):
        amx = rate(lambda n, t: micro.amx_bf16_peak(n, t, 1e-3))
    return Limits(
        threads, isa, l2_read, l3_read, dram_read, bf16, fp32, amx, *sizes
    )


def gbs(value: float) -> str:
    """A rate in units of 1e9 (GB/s, GFLOP/s), or n/a."""
    return f"{value / 1e9:.0f}" if math.isfinite(value) else "n/a"


def limits_table(limits: dict[int, Limits]) -> list[str]:
    """Markdown table of the measured limits, one column per thread count."""
    cols = sorted(limits, reverse=True)
    head = "| figure | " + " | ".join(f"{t} thread(s)" for t in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    rows = [
        ("L2 read, GB/s (buffer = half of L2 per thread)", "l2_read"),
        ("L3 read, GB/s", "l3_read"),
        ("DRAM read, GB/s", "dram_read"),
        ("vdpbf16ps peak, GFLOP/s", "bf16_dot_peak"),
        ("fp32 FMA peak, GFLOP/s", "fp32_fma_peak"),
        ("AMX tdpbf16ps peak, GFLOP/s", "amx_bf16_peak"),
    ]
    for title, attr in rows:
        vals = [gbs(getattr(limits[t], attr)) for t in cols]
        lines.append(f"| {title} | " + " | ".join(vals) + " |")
    bufs = [
        f"{limits[t].l2_buffer / _MIB:.1f} / {limits[t].l3_buffer / _MIB:.0f}"
        f" / {limits[t].dram_buffer / _MIB:.0f}"
        for t in cols
    ]
    lines.append("| buffers L2 / L3 / DRAM, MiB | " + " | ".join(bufs) + " |")
    return lines
