"""Which ISA paths a build of the extension compiles (used by setup.py).

`VLLM_CPU_LORA_BUILD_ISAS`, read at build time:
- unset or "all": every path of this architecture (a build that runs on any
  CPU of it, and the one the tests and CI use);
- "native": the paths the building CPU runs, as `supported_isas()` will list
  them, without the test-only `amx_emulated` (x86-64; elsewhere every path).
  For a build that only ever runs where it is built, such as the demo's:
  each x86 kernel unit is a large share of the compile;
- else a comma-separated list of path names, e.g. "avx2,avx512".

`scalar` is always built: it is the path of last resort. A path left out is
missing from `built_isas()` and `supported_isas()`, and forcing it with
`VLLM_CPU_LORA_ISA` is an error that says so (csrc/cpu/isa.cpp).
"""

import os
import platform

ENV = "VLLM_CPU_LORA_BUILD_ISAS"

# The optional paths, each csrc/cpu/kernels_<path>.cpp: x86-64's, then
# aarch64's (each architecture's units compile to nothing on the other).
OPTIONAL_PATHS = (
    "avx2",
    "avx512",
    "avx512_bf16",
    "amx",
    "amx_emulated",
    "neon",
    "neon_bf16",
)


def native_paths() -> set[str]:
    """The optional paths this CPU runs, from the CPU tests torch makes
    (the same cpuinfo that csrc/cpu/isa.cpp reads); every path off x86-64."""
    if platform.machine() != "x86_64":
        return set(OPTIONAL_PATHS)
    import torch

    cpu = torch.cpu
    paths = set()
    if cpu._is_avx2_supported():
        paths.add("avx2")
    if cpu._is_avx512_supported():
        paths.add("avx512")
        if cpu._is_avx512_bf16_supported():
            paths.add("avx512_bf16")
            if cpu._is_amx_tile_supported():
                paths.add("amx")
    return paths


def selected_paths(spec: str | None) -> set[str]:
    """The optional paths `spec` (the variable's value) selects."""
    spec = (spec or "all").strip()
    if spec == "all":
        return set(OPTIONAL_PATHS)
    if spec == "native":
        return native_paths()
    names = {name.strip() for name in spec.split(",") if name.strip()}
    unknown = names - {*OPTIONAL_PATHS, "scalar"}
    if unknown:
        raise ValueError(
            f"{ENV}={spec}: unknown path(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(OPTIONAL_PATHS)}, scalar; or all, native)"
        )
    return names - {"scalar"}


def kernel_sources(sources: list[str]) -> list[str]:
    """`sources` without the kernel units of the paths not selected."""
    chosen = selected_paths(os.environ.get(ENV))
    left_out = {f"kernels_{name}.cpp" for name in set(OPTIONAL_PATHS) - chosen}
    return [s for s in sources if os.path.basename(s) not in left_out]
