"""How the benchmark process allocates: glibc's malloc keeps freed memory.

vLLM's CPU docs recommend TCMalloc, which keeps freed memory for the next
allocation. glibc's malloc instead maps each block above its mmap threshold
afresh and unmaps it on free; the threshold adapts to the blocks freed so
far. The reference's per-call copies (tens of MB) then fault in new pages on
every call, or not, depending on the process's history: the same reference
call measured 2-4x apart from run to run
(docs/benchmarking.md#steady-allocator). Raising the thresholds makes malloc
reuse freed memory as TCMalloc does, whatever came before.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30  # Above any one block the benchmarks allocate.

_state = "the C library's malloc, as set by the environment"


def keep_freed_memory() -> str:
    """Tells glibc's malloc to keep freed memory; says what is in effect."""
    global _state
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt and all(
        mallopt(param, _THRESHOLD) == 1
        for param in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)
    ):
        _state = (
            "glibc malloc keeps freed memory (mmap and trim thresholds 1 "
            "GiB), as TCMalloc does, so that vLLM's per-call copies reuse it"
        )
    return _state


def state() -> str:
    """What keep_freed_memory put in effect (or the default)."""
    return _state
