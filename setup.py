"""Builds vllm_cpu_lora._C against the torch that is installed.

Install with `pip install --no-build-isolation .` so the extension is compiled
against the same torch it will run with (the C++ ABI is not stable across torch
releases). VLLM_CPU_LORA_BUILD_ISAS=native compiles only the ISA paths this
CPU runs (build_isas.py).
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

from build_isas import kernel_sources

_FLAGS = [
    "-O3",
    # No debug info: Python's build flags ask for -g, which costs about a
    # third of the compile time and makes the library 12x larger
    # (docs/vllm.md#measured). The sanitizer build below keeps it.
    "-g0",
    "-std=c++17",
    "-Wall",
    # GCC 12 false positives inside its own AVX-512 intrinsic headers.
    "-Wno-maybe-uninitialized",
    "-Wno-uninitialized",
    # at::parallel_for is header code: without OpenMP it runs serially.
    "-fopenmp",
]
if os.environ.get("VLLM_CPU_LORA_SANITIZE"):
    # ASan + UBSan build for the hardening tests (see scripts/sanitize.sh).
    _FLAGS = [
        "-O1",
        "-g",
        "-std=c++17",
        "-fsanitize=address,undefined",
        "-fno-omit-frame-pointer",
        "-fno-sanitize-recover=undefined",
        "-fopenmp",
    ]

setup(
    ext_modules=[
        CppExtension(
            "vllm_cpu_lora._C",
            # Every path's kernels unless VLLM_CPU_LORA_BUILD_ISAS says
            # otherwise (build_isas.py).
            kernel_sources(sorted(glob.glob("csrc/cpu/*.cpp"))),
            extra_compile_args=_FLAGS,
            extra_link_args=["-fopenmp"]
            + (
                ["-fsanitize=address,undefined"]
                if os.environ.get("VLLM_CPU_LORA_SANITIZE")
                else []
            ),
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
