"""Kernel benchmark: vllm_cpu_lora.ops against vLLM's algorithm and a bound.

Run with ``python -m benchmarks`` (which runs this part) or
``python -m benchmarks.kernels`` (``--quick`` for a smoke test,
``--threads all|1|both``, ``--out DIR``).

Speed is reported as ratios of medians measured side by side in one process:

* ours: ``vllm_cpu_lora.ops`` (the C++ kernels);
* reference: ``vllm_cpu_lora.reference`` (vLLM's per-token gather algorithm);
* grouped: pure torch written here, tokens grouped by adapter with one
  ``torch.mm`` per adapter (a Python loop over the adapters in use);
* bound: ``max(bytes / bandwidth, flops / peak)`` from figures measured on
  this machine by small C++ micro-kernels compiled at run time (AVX-512
  loads for read bandwidth, a register loop of ``vdpbf16ps`` / ``vfmadd``,
  and AMX ``tdpbf16ps`` where present, for peak), each with one thread and
  with all threads.

The implementations are interleaved round by round (the order rotates), each
sample runs a call in a loop long enough to time, and each median is taken
over many rounds after warm-up; rounds are bounded by a time budget so the
slow reference cases finish. Every case is checked once against the
reference before it is timed. The one absolute time quoted is the fixed cost
of a tiny B=1 call, which has an absolute target.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

import vllm_cpu_lora
from benchmarks import common
from vllm_cpu_lora import ops, reference

_HIDDEN = 4096
_RANKS = (8, 16, 64)
_ADAPTERS = (1, 4, 16)
_TOKENS = (1, 8, 32, 256)
_HOUTS = (4096, 11008)
_LLAMA3_HOUTS = (1024, 14336)
_PREFILL_TOKENS = 2048
_PREFILL_SEGMENTS = 4

# Targets from the issue.
_BGMV_VS_REFERENCE = 60.0
_BGMV_VS_GROUPED = 8.0
_FIXED_COST_US = 3.0
_SGMV_VS_REFERENCE = 100.0
_SGMV_PEAK_FRACTION = 0.75

# Sanity tolerance (real tests live in tests/): max |ours - ref| must stay
# below this fraction of the largest change the reference made to the output
# (plus a small absolute slack).
_CHECK_RTOL = 3e-2
_CHECK_ATOL = 1e-2

_MIB = 1 << 20
_GIB = 1 << 30

_IMPLS = ("ours", "reference", "grouped")

# ------------------------------------------------------------ micro-kernels

_MICRO_SRC = r"""
#include <ATen/cpu/Utils.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>

namespace {

volatile int64_t g_isink = 0;
volatile float g_fsink = 0.0f;

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Sums `bytes` (a multiple of 512) at p, `reps` times, with 8 independent
// 512-bit integer accumulators.
__attribute__((target("avx512f"))) int64_t ReadSum(const char* p,
                                                   int64_t bytes,
                                                   int64_t reps) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  __m512i a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t r = 0; r < reps; ++r) {
    const char* q = p;
    asm volatile("" : "+r"(q));  // The compiler may not fold repetitions.
    for (int64_t i = 0; i + 512 <= bytes; i += 512) {
      a0 = _mm512_add_epi32(a0, _mm512_loadu_si512(q + i));
      a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(q + i + 64));
      a2 = _mm512_add_epi32(a2, _mm512_loadu_si512(q + i + 128));
      a3 = _mm512_add_epi32(a3, _mm512_loadu_si512(q + i + 192));
      a4 = _mm512_add_epi32(a4, _mm512_loadu_si512(q + i + 256));
      a5 = _mm512_add_epi32(a5, _mm512_loadu_si512(q + i + 320));
      a6 = _mm512_add_epi32(a6, _mm512_loadu_si512(q + i + 384));
      a7 = _mm512_add_epi32(a7, _mm512_loadu_si512(q + i + 448));
    }
  }
  a0 = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
  a4 = _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a4));
}

constexpr int kAcc = 24;  // Independent accumulators: > latency x ports.

__attribute__((target("avx512f,avx512bf16"))) float DpBf16Loop(int64_t iters,
                                                               float seed) {
  __m512 acc[kAcc];
  for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_set1_ps(seed * j);
  const __m512 fa = _mm512_set1_ps(seed), fb = _mm512_set1_ps(0.5f * seed);
  __m512bh a = _mm512_cvtne2ps_pbh(fa, fa);
  __m512bh b = _mm512_cvtne2ps_pbh(fb, fb);
  // The loop may not move across the caller's clock reads: its inputs come
  // out of, and its results go into, opaque statements with a memory clobber.
  asm volatile("" : "+v"(a), "+v"(b)::"memory");
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  __m512 s = acc[0];
  asm volatile("" : "+v"(s)::"memory");
  for (int j = 1; j < kAcc; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f"))) float FmaLoop(int64_t iters, float seed) {
  __m512 acc[kAcc];
  for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_set1_ps(seed * j);
  __m512 a = _mm512_set1_ps(seed), b = _mm512_set1_ps(0.5f * seed);
  asm volatile("" : "+v"(a), "+v"(b)::"memory");
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
  }
  __m512 s = acc[0];
  asm volatile("" : "+v"(s)::"memory");
  for (int j = 1; j < kAcc; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Four independent C tiles (16 x 16 fp32) fed by two A and two B tiles
// (16 rows x 64 bytes): each tdpbf16ps is 16 x 16 x 32 x 2 = 16384 flops.
__attribute__((target("amx-tile,amx-bf16"))) float AmxLoop(int64_t iters,
                                                          float seed) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t in[16 * 32];
  const c10::BFloat16 v(seed);
  for (int i = 0; i < 16 * 32; ++i) in[i] = v.x;
  alignas(64) float res[16 * 16];
  _tile_loadd(4, in, 64);
  _tile_loadd(5, in, 64);
  _tile_loadd(6, in, 64);
  _tile_loadd(7, in, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float sum = 0.0f;
  _tile_stored(0, res, 64);
  sum += res[0];
  _tile_stored(3, res, 64);
  sum += res[255];
  _tile_release();
  return sum;
}

// Runs body(thread id), which returns a value to keep alive, on `threads`
// threads. Timed from a barrier after every thread has started to one after
// all finished, so a late thread start (a busy machine) is not counted.
struct Timed {
  double seconds;
  int threads;
  double sink;
};

template <class Body>
Timed TimedParallel(int64_t threads, Body body) {
  double sink = 0.0;
  int used = 1;
  double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
#pragma omp barrier
#pragma omp master
    t0 = Now();
    const int tid = omp_get_thread_num();
    if (tid == 0) used = omp_get_num_threads();
    sink += static_cast<double>(body(tid));
#pragma omp barrier
#pragma omp master
    t1 = Now();
  }
  return Timed{t1 - t0, used, sink};
}

}  // namespace

// FLOP/s of `threads` threads each running `iters` x 4 tdpbf16ps; 0 when
// the OS does not grant AMX tile state.
double amx_bf16_peak(int64_t iters, int64_t threads, double seed) {
  if (!at::cpu::init_amx()) return 0.0;
  const Timed r = TimedParallel(threads, [&](int) {
    return AmxLoop(iters, static_cast<float>(seed));
  });
  g_fsink = static_cast<float>(r.sink);
  return 16384.0 * 4 * iters * r.threads / r.seconds;
}

// Bytes per second read from `buf` by `threads` threads, each summing its own
// slice `reps` times.
double read_bandwidth(torch::Tensor buf, int64_t reps, int64_t threads) {
  const char* p = static_cast<const char*>(buf.data_ptr());
  const int64_t bytes = buf.numel() * buf.element_size();
  const int64_t slice = bytes / threads / 512 * 512;
  const Timed r = TimedParallel(
      threads, [&](int tid) { return ReadSum(p + tid * slice, slice, reps); });
  g_isink = static_cast<int64_t>(r.sink);
  return static_cast<double>(slice) * r.threads * reps / r.seconds;
}

// FLOP/s of `threads` threads each running `iters` x kAcc vdpbf16ps
// (64 flops each: 16 lanes x 2 products x multiply-add).
double bf16_dot_peak(int64_t iters, int64_t threads, double seed) {
  const Timed r = TimedParallel(threads, [&](int) {
    return DpBf16Loop(iters, static_cast<float>(seed));
  });
  g_fsink = static_cast<float>(r.sink);
  return 64.0 * kAcc * iters * r.threads / r.seconds;
}

// FLOP/s of `threads` threads each running `iters` x kAcc vfmadd231ps
// (32 flops each).
double fp32_fma_peak(int64_t iters, int64_t threads, double seed) {
  const Timed r = TimedParallel(threads, [&](int) {
    return FmaLoop(iters, static_cast<float>(seed));
  });
  g_fsink = static_cast<float>(r.sink);
  return 32.0 * kAcc * iters * r.threads / r.seconds;
}
"""


def load_micro_kernels():
    """Compiles (once; cached in common.build_dir) the micro-kernels."""
    from torch.utils import cpp_extension

    return cpp_extension.load_inline(
        name="bench_ops_micro",
        cpp_sources=[_MICRO_SRC],
        functions=[
            "read_bandwidth",
            "bf16_dot_peak",
            "fp32_fma_peak",
            "amx_bf16_peak",
        ],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(common.build_dir("micro")),
        verbose=False,
    )


# ---------------------------------------------------------------- machine


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cpu_model() -> str:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def _cache_sizes() -> dict[int, int]:
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


@dataclasses.dataclass
class Limits:
    """Measured machine limits for one thread count (bytes/s, flop/s)."""

    threads: int
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

    def peak(self) -> float:
        """The largest peak: any of the instructions can do the work (bf16
        widens exactly to fp32), so no one of them alone bounds the time."""
        peaks = [self.bf16_dot_peak, self.fp32_fma_peak, self.amx_bf16_peak]
        return max((p for p in peaks if math.isfinite(p)), default=math.nan)


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


def measure_limits(micro, threads: int, quick: bool) -> Limits:
    """Measures read bandwidth (L2, L3, DRAM) and peaks with `threads`."""
    flags = _cpu_flags()
    caches = _cache_sizes()
    l2_core = caches.get(2, 1 * _MIB)
    l3 = caches.get(3, 32 * _MIB)
    l2_buffer = l2_core // 2 * threads
    l3_buffer = min(max(16 * _MIB, 4 * l2_core * threads), l3 // 2)
    dram_buffer = max(_GIB, 4 * l3)
    target = 0.03 if quick else 0.08
    nan = float("nan")
    if "avx512f" not in flags:
        print("warning: no AVX-512: machine limits not measured")
        return Limits(
            threads,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            l2_core * threads,
            l3,
            l2_buffer,
            l3_buffer,
            dram_buffer,
        )

    def bandwidth(nbytes: int) -> float:
        buf = torch.ones(nbytes, dtype=torch.uint8)  # Touch every page.
        micro.read_bandwidth(buf, 2, threads)
        return _best_rate(
            lambda n, t: micro.read_bandwidth(buf, n, t),
            threads,
            True,
            quick,
            target,
        )

    l2_read = bandwidth(l2_buffer)
    l3_read = bandwidth(l3_buffer)
    buf = torch.ones(dram_buffer, dtype=torch.uint8)
    dram_read = max(
        micro.read_bandwidth(buf, 1, threads) for _ in range(2 if quick else 4)
    )
    del buf
    bf16 = nan
    if "avx512_bf16" in flags:
        bf16 = _best_rate(
            lambda n, t: micro.bf16_dot_peak(n, t, 1e-3),
            threads,
            False,
            quick,
            target,
        )
    fp32 = _best_rate(
        lambda n, t: micro.fp32_fma_peak(n, t, 1e-3),
        threads,
        False,
        quick,
        target,
    )
    amx = nan
    if {"amx_tile", "amx_bf16"} <= flags and micro.amx_bf16_peak(1, 1, 1e-3):
        amx = _best_rate(
            lambda n, t: micro.amx_bf16_peak(n, t, 1e-3),
            threads,
            False,
            quick,
            target,
        )
    return Limits(
        threads=threads,
        l2_read=l2_read,
        l3_read=l3_read,
        dram_read=dram_read,
        bf16_dot_peak=bf16,
        fp32_fma_peak=fp32,
        amx_bf16_peak=amx,
        l2_bytes=l2_core * threads,
        l3_bytes=l3,
        l2_buffer=l2_buffer,
        l3_buffer=l3_buffer,
        dram_buffer=dram_buffer,
    )


def describe_machine(all_threads: int) -> dict:
    """CPU model, relevant ISA flags, caches, threads, versions, date."""
    flags = _cpu_flags()
    wanted = sorted(
        f
        for f in flags
        if f.startswith(("avx512", "amx"))
        or f in ("avx2", "fma", "f16c", "avx_vnni", "hypervisor")
    )
    caches = _cache_sizes()
    return {
        "cpu": _cpu_model(),
        "flags": wanted,
        "logical_cpus": os.cpu_count(),
        "threads_all": all_threads,
        "caches_per_instance": {f"L{k}": v for k, v in sorted(caches.items())},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "isa_path": vllm_cpu_lora.isa(),
        "supported_isas": vllm_cpu_lora.supported_isas(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "load_average_start": common.load_average(),
    }


# ------------------------------------------------------ grouped pure torch


def _group_rows(indices: torch.Tensor, num_adapters: int):
    """Yields (adapter, token rows) for every adapter in use (indices >= 0)."""
    order = torch.argsort(indices, stable=True)
    counts = torch.bincount(indices, minlength=num_adapters).tolist()
    start = 0
    for adapter, count in enumerate(counts):
        if count:
            yield adapter, order[start : start + count]
            start += count


def grouped_bgmv_shrink(x, weights, out, indices, scaling=1.0):
    """out[rows] = scaling * x[rows] @ A[a].T, one torch.mm per adapter."""
    weights = weights.squeeze(1) if weights.dim() == 4 else weights
    rank = weights.size(1)
    for adapter, rows in _group_rows(indices, weights.size(0)):
        prod = torch.mm(x.index_select(0, rows), weights[adapter].t())
        prod = prod.to(out.dtype)
        if scaling != 1.0:
            prod.mul_(scaling)
        out[:, :rank].index_copy_(0, rows, prod)


def grouped_bgmv_expand(y, weights, out, indices, add_inputs=True):
    """out[rows] (+)= y[rows] @ B[a].T, one torch.mm per adapter."""
    weights = weights.squeeze(1) if weights.dim() == 4 else weights
    width = min(weights.size(1), out.size(1))
    target = out if width == out.size(1) else out[:, :width]
    for adapter, rows in _group_rows(indices, weights.size(0)):
        ys = y.index_select(0, rows).to(weights.dtype)
        prod = torch.mm(ys, weights[adapter, :width].t()).to(out.dtype)
        if add_inputs:
            target.index_add_(0, rows, prod)
        else:
            target.index_copy_(0, rows, prod)


def _segments(starts, lengths, indices, batches):
    for start, length, adapter in zip(
        starts[:batches].tolist(),
        lengths[:batches].tolist(),
        indices[:batches].tolist(),
        strict=True,
    ):
        if length and adapter >= 0:
            yield slice(start, start + length), adapter


def grouped_sgmv_shrink(
    x, weights, out, starts, lengths, indices, batches, scaling=1.0
):
    """Per segment: out[seg] = scaling * x[seg] @ A[a].T (one torch.mm)."""
    weights = weights.squeeze(1) if weights.dim() == 4 else weights
    rank = weights.size(1)
    for seg, adapter in _segments(starts, lengths, indices, batches):
        dest = out[seg, :rank]
        if dest.dtype == x.dtype and dest.is_contiguous():
            torch.mm(x[seg], weights[adapter].t(), out=dest)
        else:
            dest.copy_(torch.mm(x[seg], weights[adapter].t()))
        if scaling != 1.0:
            dest.mul_(scaling)


def grouped_sgmv_expand(
    y, weights, out, starts, lengths, indices, batches, add_inputs=False
):
    """Per segment: out[seg] (+)= y[seg] @ B[a].T (one addmm / mm)."""
    weights = weights.squeeze(1) if weights.dim() == 4 else weights
    width = min(weights.size(1), out.size(1))
    for seg, adapter in _segments(starts, lengths, indices, batches):
        dest = out[seg, :width]
        ys = y[seg].to(weights.dtype)
        if add_inputs and dest.dtype == ys.dtype:
            dest.addmm_(ys, weights[adapter, :width].t())
        elif add_inputs:
            dest.add_(torch.mm(ys, weights[adapter, :width].t()))
        else:
            dest.copy_(torch.mm(ys, weights[adapter, :width].t()))


# ------------------------------------------------------------------ cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case."""

    op: str  # bgmv_shrink, bgmv_expand, sgmv_shrink, sgmv_expand
    tokens: int
    adapters: int
    rank: int
    hout: int = 0  # Expand only.
    dtype: str = "bf16"  # bf16: vLLM's CPU dtypes; fp32: everything fp32.
    shared: bool = False  # Every token on one adapter (else random).

    @property
    def family(self) -> str:
        return self.op.split("_", 1)[0]

    @property
    def core(self) -> bool:
        """One of the cases the issue's targets are defined over."""
        return (
            self.dtype == "bf16"
            and not self.shared
            and self.hout in (0, *_HOUTS)
        )

    @property
    def label(self) -> str:
        text = f"{self.op} T{self.tokens} L{self.adapters} r{self.rank}"
        if self.op.endswith("expand"):
            text += f" N{self.hout}"
        if self.dtype != "bf16":
            text += f" {self.dtype}"
        return text + (" shared" if self.shared else "")


def build_cases(quick: bool) -> list[Case]:
    """The issue's cases (or a small subset with quick)."""
    ranks = (16,) if quick else _RANKS
    adapters = (1, 16) if quick else _ADAPTERS
    tokens = (1, 32) if quick else _TOKENS
    houts = (4096,) if quick else _HOUTS
    cases = []
    for r in ranks:
        for n_adapters in adapters:
            for b in tokens:
                cases.append(Case("bgmv_shrink", b, n_adapters, r))
                for hout in houts:
                    cases.append(Case("bgmv_expand", b, n_adapters, r, hout))
    for r in ranks:
        cases.append(Case("sgmv_shrink", _PREFILL_TOKENS, _PREFILL_SEGMENTS, r))
        for hout in houts:
            cases.append(
                Case("sgmv_expand", _PREFILL_TOKENS, _PREFILL_SEGMENTS, r, hout)
            )
    if quick:
        return cases
    # Beyond the targets' grid: every token on one adapter, fp32 throughout,
    # and Llama-3-8B's widths (k/v 1024, MLP 14336; its hidden size is 4096).
    for b in (1, 32, 256):
        cases.append(Case("bgmv_shrink", b, 16, 16, shared=True))
        cases.append(Case("bgmv_expand", b, 16, 16, 11008, shared=True))
        cases.append(Case("bgmv_shrink", b, 4, 16, dtype="fp32"))
        cases.append(Case("bgmv_expand", b, 4, 16, 11008, dtype="fp32"))
        for hout in _LLAMA3_HOUTS:
            cases.append(Case("bgmv_expand", b, 4, 16, hout))
    segs = _PREFILL_SEGMENTS
    cases.append(Case("sgmv_shrink", _PREFILL_TOKENS, segs, 16, dtype="fp32"))
    cases.append(
        Case("sgmv_expand", _PREFILL_TOKENS, segs, 16, 11008, dtype="fp32")
    )
    for hout in _LLAMA3_HOUTS:
        cases.append(Case("sgmv_expand", _PREFILL_TOKENS, segs, 16, hout))
    return cases


@dataclasses.dataclass
class Prepared:
    """Callables for one case, each with its own output tensor."""

    calls: dict[str, Callable[[], None]]
    outs: dict[str, torch.Tensor]
    initial_out: torch.Tensor
    adapters_used: int
    bytes: int
    flops: int


def prepare(case: Case, seed: int = 0) -> Prepared:
    """Builds inputs, the three implementations' calls and the cost model."""
    gen = torch.Generator().manual_seed(seed)
    # bf16: vLLM's CPU dtypes (bf16 activations and weights, the fp32
    # intermediate buffer between shrink and expand); fp32: all fp32.
    bf16 = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    h, r, t, n_ad = _HIDDEN, case.rank, case.tokens, case.adapters

    def randn(*shape, scale=1.0, dtype=bf16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    if case.family == "bgmv" and case.shared:
        indices = torch.full((t,), n_ad - 1)
        used = 1
    elif case.family == "bgmv":
        indices = torch.randint(0, n_ad, (t,), generator=gen)
        used = int(torch.unique(indices).numel())
    else:
        seg = t // _PREFILL_SEGMENTS
        starts = torch.arange(_PREFILL_SEGMENTS) * seg
        lengths = torch.full((_PREFILL_SEGMENTS,), seg)
        indices = torch.arange(_PREFILL_SEGMENTS) % n_ad
        used = int(torch.unique(indices).numel())
        seg_args = (starts, lengths, indices, _PREFILL_SEGMENTS)
        hints = (seg, t)  # max_seq_length, token_nums

    if case.op.endswith("shrink"):
        x = randn(t, h)
        w = randn(n_ad, r, h, scale=h**-0.5)
        out_dtype = torch.float32 if case.family == "bgmv" else bf16
        initial = torch.zeros(t, r, dtype=out_dtype)
        nbytes = (
            used * r * h * w.element_size()
            + x.numel() * x.element_size()
            + initial.numel() * initial.element_size()
        )
        flops = 2 * t * r * h
    else:
        n = case.hout
        in_dtype = torch.float32 if case.family == "bgmv" else bf16
        x = randn(t, r, dtype=in_dtype)
        w = randn(n_ad, n, r, scale=r**-0.5)
        initial = randn(t, n, scale=1e-2)
        nbytes = (
            used * n * r * w.element_size()
            + x.numel() * x.element_size()
            + 2 * initial.numel() * initial.element_size()
        )
        flops = 2 * t * r * n

    outs = {name: initial.clone() for name in _IMPLS}
    if case.op == "bgmv_shrink":
        fns = (ops.bgmv_shrink, reference.bgmv_shrink, grouped_bgmv_shrink)
        calls = {
            name: (lambda f=f, o=outs[name]: f(x, w, o, indices, 1.0))
            for name, f in zip(_IMPLS, fns, strict=True)
        }
    elif case.op == "bgmv_expand":
        fns = (ops.bgmv_expand, reference.bgmv_expand, grouped_bgmv_expand)
        calls = {
            name: (lambda f=f, o=outs[name]: f(x, w, o, indices, True))
            for name, f in zip(_IMPLS, fns, strict=True)
        }
    elif case.op == "sgmv_shrink":
        calls = {
            "ours": lambda o=outs["ours"]: ops.sgmv_shrink(
                x, w, o, *seg_args, *hints, 1.0
            ),
            "reference": lambda o=outs["reference"]: reference.sgmv_shrink(
                x, w, o, *seg_args, *hints, 1.0
            ),
            "grouped": lambda o=outs["grouped"]: grouped_sgmv_shrink(
                x, w, o, *seg_args, 1.0
            ),
        }
    else:
        calls = {
            "ours": lambda o=outs["ours"]: ops.sgmv_expand(
                x, w, o, *seg_args, *hints, True
            ),
            "reference": lambda o=outs["reference"]: reference.sgmv_expand(
                x, w, o, *seg_args, *hints, True
            ),
            "grouped": lambda o=outs["grouped"]: grouped_sgmv_expand(
                x, w, o, *seg_args, True
            ),
        }
    return Prepared(calls, outs, initial, used, nbytes, flops)


def check(prep: Prepared) -> tuple[dict[str, float], dict[str, float]]:
    """Runs every implementation once (also the first warm-up).

    Returns:
        max |impl - reference| / max |reference delta| for ours and grouped,
        and the seconds each first call took.

    Raises:
        AssertionError: an implementation is far from the reference.
    """
    first = {}
    for name in _IMPLS:
        prep.outs[name].copy_(prep.initial_out)
        first[name] = _time_calls(prep.calls[name], 1)
    want = prep.outs["reference"].float()
    delta = (want - prep.initial_out.float()).abs().max().item()
    errors = {}
    for name in ("ours", "grouped"):
        got = prep.outs[name].float()
        err = (got - want).abs().max().item()
        errors[name] = err / max(delta, 1e-30)
        if not err <= _CHECK_RTOL * delta + _CHECK_ATOL:
            raise AssertionError(
                f"{name} differs from the reference: max abs error {err:.3g}"
                f" (reference delta max {delta:.3g})"
            )
    return errors, first


# ----------------------------------------------------------------- timing


def _time_calls(fn: Callable[[], None], count: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(count):
        fn()
    return (time.perf_counter_ns() - start) / count * 1e-9


def measure_interleaved(
    calls: dict[str, Callable[[], None]],
    budget_s: float,
    sample_s: float,
    max_rounds: int = 200,
    first_call_s: dict[str, float] | None = None,
    settle_s: float = 5e-3,
) -> dict[str, dict]:
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
        settle_s: least duration of the untimed calls before a sample.
        first_call_s: how long a first call took; a callable slower than
            50 ms is sized from it instead of a second warm-up call.

    Returns:
        Per callable: median_s, rounds, calls_per_sample.
    """
    names = list(calls)
    first_call_s = first_call_s or {}
    inner = {}
    for name in names:
        once = first_call_s.get(name, 0.0)
        if once < 0.05:
            once = _time_calls(calls[name], 1)  # Second warm-up, and a size.
        inner[name] = max(1, min(100_000, int(sample_s / once)))
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        rounds = 0
        min_rounds = 7
        while True:
            shift = rounds % len(names)
            for name in names[shift:] + names[:shift]:
                count = inner[name]
                settle = time.perf_counter() + settle_s
                calls[name]()
                while time.perf_counter() < settle:
                    calls[name]()
                samples[name].append(_time_calls(calls[name], count))
            rounds += 1
            elapsed = time.perf_counter() - start
            if rounds == 1 and elapsed > budget_s / 4:
                min_rounds = 3
            if rounds >= max_rounds or (
                rounds >= min_rounds and elapsed >= budget_s
            ):
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        name: {
            "median_s": statistics.median(samples[name]),
            "rounds": len(samples[name]),
            "calls_per_sample": inner[name],
        }
        for name in names
    }


def fixed_cost(quick: bool) -> dict[str, float]:
    """Median microseconds of a tiny B=1 bgmv_shrink (r=16, H=16, L=1)."""
    x = torch.randn(1, 16).to(torch.bfloat16)
    w = torch.randn(1, 16, 16).to(torch.bfloat16)
    out = torch.zeros(1, 16)
    idx = torch.zeros(1, dtype=torch.long)
    raw = torch.ops.vllm_cpu_lora.bgmv_shrink
    calls = {
        "ops": lambda: ops.bgmv_shrink(x, w, out, idx, 1.0),
        "torch_ops": lambda: raw(x, w, out, idx, 1.0),
    }
    for fn in calls.values():
        for _ in range(200):
            fn()
    timed = measure_interleaved(
        calls, budget_s=0.3 if quick else 1.5, sample_s=2e-3, max_rounds=400
    )
    return {name: v["median_s"] * 1e6 for name, v in timed.items()}


# ---------------------------------------------------------------- running


def run_cases(
    cases: Sequence[Case], limits: Limits, budget_s: float, sample_s: float
) -> tuple[list[dict], list[str]]:
    """Checks and times every case with the current torch thread count."""
    threads = torch.get_num_threads()
    results, failures = [], []
    bar = common.progress(cases, f"{threads} thread(s)")
    for i, case in enumerate(bar):
        prep = prepare(case, seed=i)
        try:
            errors, first = check(prep)
        except AssertionError as exc:  # Never time a wrong kernel.
            failures.append(f"{case.label} (threads {threads}): {exc}")
            common.say(f"  {case.label:<36} CHECK FAILED: {exc}")
            continue
        timed = measure_interleaved(
            prep.calls, budget_s, sample_s, first_call_s=first
        )
        med = {name: timed[name]["median_s"] for name in _IMPLS}
        working_set = prep.bytes
        bandwidth, level = limits.bandwidth_for(working_set)
        mem_s = prep.bytes / bandwidth
        flop_s = prep.flops / limits.peak()
        bound = max(mem_s, flop_s)
        result = {
            "label": case.label,
            **dataclasses.asdict(case),
            "family": case.family,
            "core": case.core,
            "hidden": _HIDDEN,
            "threads": threads,
            "adapters_used": prep.adapters_used,
            "bytes": prep.bytes,
            "flops": prep.flops,
            "bandwidth_level": level,
            "bound_s": bound,
            "bound_by": "memory" if mem_s >= flop_s else "compute",
            "timing": timed,
            "median_s": med,
            "check_rel_error": errors,
            "speedup_vs_reference": med["reference"] / med["ours"],
            "speedup_vs_grouped": med["grouped"] / med["ours"],
            "grouped_vs_reference": med["reference"] / med["grouped"],
            "fraction_of_bound": bound / med["ours"],
            "fraction_of_bf16_peak": prep.flops
            / med["ours"]
            / limits.bf16_dot_peak,
        }
        results.append(result)
        common.say(
            f"  {case.label:<40} vs ref {result['speedup_vs_reference']:8.1f}x"
            f"  vs grouped {result['speedup_vs_grouped']:7.2f}x"
            f"  bound {100 * result['fraction_of_bound']:6.1f}%"
            f" ({level}, {result['bound_by']})"
        )
        del prep
    return results, failures


def _num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def geomean(values: Sequence[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(
    results: list[dict], fixed: dict[int, dict], all_threads: int
) -> tuple[dict, list[tuple[str, bool | None, str]]]:
    """Geomeans per thread count and PASS/FAIL lines for the targets."""
    summary: dict[str, dict] = {}
    targets: list[tuple[str, bool | None, str]] = []
    for threads in sorted({r["threads"] for r in results}, reverse=True):
        rows = [r for r in results if r["threads"] == threads and r.get("core")]
        bgmv = [r for r in rows if r["family"] == "bgmv"]
        sgmv = [r for r in rows if r["family"] == "sgmv"]
        s = {
            "bgmv_vs_reference": geomean(
                [r["speedup_vs_reference"] for r in bgmv]
            ),
            "bgmv_vs_grouped": geomean([r["speedup_vs_grouped"] for r in bgmv]),
            "bgmv_fraction_of_bound": geomean(
                [r["fraction_of_bound"] for r in bgmv]
            ),
            "sgmv_vs_reference": geomean(
                [r["speedup_vs_reference"] for r in sgmv]
            ),
            "sgmv_vs_grouped": geomean([r["speedup_vs_grouped"] for r in sgmv]),
            "sgmv_fraction_of_bf16_peak": geomean(
                [r["fraction_of_bf16_peak"] for r in sgmv]
            ),
            "fixed_cost_us": fixed.get(threads, {}).get("ops", float("nan")),
        }
        summary[str(threads)] = s
        tag = f"[{threads} thread{'s' if threads > 1 else ''}]"

        def add(name, value, ok, want, tag=tag):
            if math.isnan(value):
                targets.append((f"{tag} {name}", None, "no cases"))
            else:
                targets.append((f"{tag} {name}", ok, f"{_num(value)} ({want})"))

        v = s["bgmv_vs_reference"]
        add(
            "bgmv geomean speed-up over reference",
            v,
            v >= _BGMV_VS_REFERENCE,
            f">= {_BGMV_VS_REFERENCE:g}x",
        )
        v = s["bgmv_vs_grouped"]
        add(
            "bgmv geomean speed-up over grouped torch",
            v,
            v >= _BGMV_VS_GROUPED,
            f">= {_BGMV_VS_GROUPED:g}x",
        )
        v = s["fixed_cost_us"]
        add(
            "B=1 fixed cost, us",
            v,
            v <= _FIXED_COST_US,
            f"<= {_FIXED_COST_US:g} us",
        )
        v = s["sgmv_vs_reference"]
        add(
            "sgmv geomean speed-up over reference",
            v,
            v >= _SGMV_VS_REFERENCE,
            f">= {_SGMV_VS_REFERENCE:g}x",
        )
        if threads == all_threads:
            v = s["sgmv_fraction_of_bf16_peak"]
            add(
                "sgmv geomean fraction of vdpbf16ps peak",
                v,
                v >= _SGMV_PEAK_FRACTION,
                f">= {_SGMV_PEAK_FRACTION:g}",
            )
    if str(all_threads) not in summary:
        targets.append(
            (
                f"[{all_threads} threads] sgmv geomean fraction of vdpbf16ps "
                "peak",
                None,
                "not run (needs all threads)",
            )
        )
    return summary, targets


# ---------------------------------------------------------------- outputs


def _gbs(v: float) -> str:
    return f"{v / 1e9:.0f}" if math.isfinite(v) else "n/a"


def limits_table(limits: dict[int, Limits]) -> list[str]:
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
        vals = [_gbs(getattr(limits[t], attr)) for t in cols]
        lines.append(f"| {title} | " + " | ".join(vals) + " |")
    bufs = [
        f"{limits[t].l2_buffer / _MIB:.1f} / {limits[t].l3_buffer / _MIB:.0f}"
        f" / {limits[t].dram_buffer / _MIB:.0f}"
        for t in cols
    ]
    lines.append("| buffers L2 / L3 / DRAM, MiB | " + " | ".join(bufs) + " |")
    return lines


def results_table(results: list[dict], markdown: bool) -> list[str]:
    head = (
        "threads",
        "case",
        "vs reference",
        "vs grouped",
        "grouped vs ref",
        "of bound",
        "bound by",
        "of bf16 peak",
    )
    rows = []
    for r in results:
        rows.append(
            (
                str(r["threads"]),
                r["label"],
                f"{r['speedup_vs_reference']:.1f}x",
                f"{r['speedup_vs_grouped']:.2f}x",
                f"{r['grouped_vs_reference']:.1f}x",
                f"{100 * r['fraction_of_bound']:.0f}%",
                f"{r['bandwidth_level']} {r['bound_by']}",
                f"{100 * r['fraction_of_bf16_peak']:.1f}%",
            )
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return lines
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = "  ".join(
        f"{{:>{w}}}" if i != 1 else f"{{:<{w}}}" for i, w in enumerate(widths)
    )
    return [fmt.format(*head)] + [fmt.format(*row) for row in rows]


def target_lines(targets) -> list[str]:
    lines = []
    for name, ok, detail in targets:
        status = "N/A " if ok is None else ("PASS" if ok else "FAIL")
        lines.append(f"{status}  {name}: {detail}")
    return lines


def write_markdown(
    path,
    machine,
    limits,
    fixed,
    results,
    summary,
    targets,
    failures,
    quick,
    elapsed,
):
    m = machine
    lines = [
        "# vllm_cpu_lora kernel benchmark (ops)",
        "",
        "Generated by `python -m benchmarks.kernels"
        + (" --quick" if quick else "")
        + "`"
        + f" on {m['date']} in {elapsed:.0f} s.",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs; torch uses "
        f"{m['threads_all']} threads)",
        f"- Flags: {' '.join(m['flags'])}",
        "- Caches per instance (sysfs; a VM may report its host's): "
        + ", ".join(
            f"{k} {v / _MIB:g} MiB" for k, v in m["caches_per_instance"].items()
        ),
        f"- torch {m['torch']}, Python {m['python']}; vllm_cpu_lora ISA "
        f"path `{m['isa_path']}` (supported: {', '.join(m['supported_isas'])})",
        f"- 1-minute load average {m['load_average_start']:.1f} at the start, "
        f"{m['load_average_end']:.1f} at the end: other work on the cores "
        "makes the figures noisy, and multi-threaded ones unreliable (a "
        "parallel region waits for its last thread to be scheduled).",
        "",
        "## Measured limits",
        "",
        "Micro-kernels compiled at run time (best of several runs): AVX-512 "
        "loads summed for read bandwidth, each thread on its own slice; "
        "a register loop of `vdpbf16ps` (64 flop each) or `vfmadd231ps` "
        "(32 flop) with 24 independent accumulators per thread for peak; "
        "where the CPU has AMX, `tdpbf16ps` on four independent C tiles.",
        "",
        *limits_table(limits),
        "",
        "## Method",
        "",
        "- ours = `vllm_cpu_lora.ops`; reference = `vllm_cpu_lora.reference` "
        "(vLLM's per-token gather); grouped = pure torch in this script "
        "(tokens grouped by adapter, one `torch.mm` per adapter in a Python "
        "loop).",
        "- Interleaved rounds, order rotating, medians over rounds; each "
        "sample follows at least 5 ms of untimed calls of the same "
        "implementation (its steady state); each case checked once against "
        "the reference first.",
        "- bgmv (decode): x bf16 [T, 4096], A bf16 [L, r, 4096] -> fp32 "
        "[T, r]; expand y fp32 [T, r], B bf16 [L, N, r] -> bf16 [T, N] with "
        "add_inputs; a random adapter per token.",
        "- sgmv (prefill): 2048 tokens in 4 segments of 512, one adapter "
        "each, bf16 activations both ways, add_inputs on expand.",
        "- Bound = max(bytes / bandwidth, flops / peak) with the thread "
        "count of the run, peak being the largest of the vdpbf16ps, fp32 "
        "FMA and AMX peaks. Bytes: the weights of the adapters in use, "
        "the inputs, the output (read and written for expand). **Bandwidth "
        "is in-cache**: the weights are hot (decode reuses them every step), "
        "so a case whose bytes fit in 3/4 of the threads' L2 uses the L2 "
        "figure, else the L3 figure (DRAM only beyond half the L3). "
        "'of bound' = bound time / our time (100% = at the bound).",
        "- 'of bf16 peak' = flops / our time / measured vdpbf16ps peak "
        "(a kernel on the AMX path can pass 100%).",
        "",
        "## Fixed cost of a B=1 call",
        "",
        "Median time of a tiny `bgmv_shrink` (B=1, r=16, H=16, L=1), through "
        "`vllm_cpu_lora.ops` and straight through `torch.ops` (target <= "
        f"{_FIXED_COST_US:g} us for ops):",
        "",
        "| threads | ops, us | torch.ops, us |",
        "|---|---|---|",
    ]
    for t in sorted(fixed, reverse=True):
        lines.append(
            f"| {t} | {fixed[t]['ops']:.2f} | {fixed[t]['torch_ops']:.2f} |"
        )
    lines += ["", "## Results (ratios)", "", *results_table(results, True), ""]
    lines += [
        "## Summary (geomeans over cases)",
        "",
        "Over the targets' grid only (bf16, a random adapter per token, "
        "Hout 4096 / 11008); the cases marked `shared` (every token on one "
        "adapter), `fp32` and N1024 / N14336 (Llama-3-8B) are in the table "
        "above, not in these figures.",
        "",
    ]
    keys = sorted(summary, key=int, reverse=True)
    lines.append("| figure | " + " | ".join(f"{k} thr" for k in keys) + " |")
    lines.append("|---|" + "---|" * len(keys))
    for key in next(iter(summary.values()), {}):
        vals = [_num(summary[k][key]) for k in keys]
        lines.append(f"| {key} | " + " | ".join(vals) + " |")
    lines += ["", "## Targets", "", "```", *target_lines(targets)]
    lines += [f"FAIL  correctness: {f}" for f in failures]
    lines += ["```", ""]
    pathlib.Path(path).write_text("\n".join(lines))


def write_plot(path, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in results))
    pos = {label: i for i, label in enumerate(labels)}
    fig, axes = plt.subplots(
        2, 1, figsize=(max(10, 0.14 * len(labels) + 3), 9), sharex=True
    )
    colors = {
        "bgmv_shrink": "C0",
        "bgmv_expand": "C1",
        "sgmv_shrink": "C2",
        "sgmv_expand": "C3",
    }
    markers = {}
    for threads in sorted({r["threads"] for r in results}, reverse=True):
        markers[threads] = "o" if not markers else "^"
        rows = [r for r in results if r["threads"] == threads]
        for op, color in colors.items():
            sel = [r for r in rows if r["op"] == op]
            if not sel:
                continue
            xs = [pos[r["label"]] for r in sel]
            axes[0].scatter(
                xs,
                [r["speedup_vs_reference"] for r in sel],
                s=14,
                color=color,
                marker=markers[threads],
                label=f"{op}, {threads} thr",
            )
            axes[1].scatter(
                xs,
                [100 * r["fraction_of_bound"] for r in sel],
                s=14,
                color=color,
                marker=markers[threads],
            )
    axes[0].set_yscale("log")
    axes[0].set_ylabel("speed-up over reference (x)")
    axes[0].axhline(_BGMV_VS_REFERENCE, color="gray", lw=0.6, ls="--")
    axes[0].axhline(_SGMV_VS_REFERENCE, color="gray", lw=0.6, ls=":")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0].grid(True, which="both", lw=0.3)
    axes[1].set_ylabel("fraction of bound (%)")
    axes[1].axhline(100, color="gray", lw=0.6, ls="--")
    axes[1].grid(True, lw=0.3)
    axes[1].set_xticks(range(len(labels)))
    axes[1].set_xticklabels(labels, rotation=90, fontsize=5)
    fig.suptitle("vllm_cpu_lora ops: ratios measured side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return common.parse_args(
        argv, __doc__.split("\n")[0], "small subset (smoke test)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out or common.default_out_dir(args.quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    all_threads = torch.get_num_threads()
    thread_counts = common.thread_counts(args.threads, all_threads)
    machine = describe_machine(all_threads)
    print(f"CPU: {machine['cpu']}; flags: {' '.join(machine['flags'])}")
    print(
        f"torch {machine['torch']}, threads {thread_counts}, "
        f"ISA path {machine['isa_path']}"
    )
    if machine["load_average_start"] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: load average {machine['load_average_start']:.1f} on "
            f"{os.cpu_count()} CPUs: other work will skew the figures"
        )

    micro = load_micro_kernels()
    cases = build_cases(args.quick)
    budget_s = 0.15 if args.quick else 0.5
    sample_s = 1e-3 if args.quick else 2e-3

    limits: dict[int, Limits] = {}
    fixed: dict[int, dict] = {}
    results: list[dict] = []
    failures: list[str] = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            lim = measure_limits(micro, threads, args.quick)
            limits[threads] = lim
            print(
                f"\n[{threads} thread(s)] read GB/s: L2 {_gbs(lim.l2_read)}, "
                f"L3 {_gbs(lim.l3_read)}, DRAM {_gbs(lim.dram_read)}; "
                f"GFLOP/s: vdpbf16ps {_gbs(lim.bf16_dot_peak)}, "
                f"fp32 FMA {_gbs(lim.fp32_fma_peak)}, "
                f"AMX {_gbs(lim.amx_bf16_peak)}"
            )
            fixed[threads] = fixed_cost(args.quick)
            print(
                f"  B=1 fixed cost: ops {fixed[threads]['ops']:.2f} us, "
                f"torch.ops {fixed[threads]['torch_ops']:.2f} us"
            )
            res, fails = run_cases(cases, lim, budget_s, sample_s)
            results += res
            failures += fails
    finally:
        torch.set_num_threads(all_threads)

    machine["load_average_end"] = common.load_average()
    summary, targets = summarize(results, fixed, all_threads)
    elapsed = time.perf_counter() - started
    print()
    print("\n".join(results_table(results, markdown=False)))
    print()
    print("\n".join(target_lines(targets)))
    for f in failures:
        print(f"FAIL  correctness: {f}")
    print(f"\n{len(results)} cases in {elapsed:.0f} s; results in {out_dir}")

    (out_dir / "ops.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "quick": args.quick,
                "elapsed_s": elapsed,
                "limits": {
                    str(t): dataclasses.asdict(v) for t, v in limits.items()
                },
                "fixed_cost_us": {str(t): v for t, v in fixed.items()},
                "results": results,
                "summary": summary,
                "targets": [
                    {"name": n, "pass": ok, "detail": d} for n, ok, d in targets
                ],
                "correctness_failures": failures,
            },
            indent=1,
            allow_nan=True,
        )
    )
    write_markdown(
        out_dir / "ops.md",
        machine,
        limits,
        fixed,
        results,
        summary,
        targets,
        failures,
        args.quick,
        elapsed,
    )
    if results:
        write_plot(out_dir / "ops.png", results)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
