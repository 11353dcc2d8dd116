"""``python -m benchmarks``: the performance report, one command.

By default runs the kernel part (a few minutes, with a progress bar); flags
add the long parts. Each part writes ``<part>.md``, ``.json`` and ``.png``
to the output folder (default: benchmarks/results/<cpu slug> of the checkout
run from, e.g. benchmarks/results/amd-epyc-zen3-avx2; --quick runs go to its
quick subfolder).

  --layer   LoRA's share of a Llama-7B layer's time (cold adapters), and
            what one call per module saves (fused_calls)
  --vllm    CPU vLLM decode tokens/s, no LoRA vs vLLM's ops vs ours; runs in
            the vLLM environment (scripts/setup_vllm_env.sh) when this one
            has no vLLM
  --ipex    Intel Extension for PyTorch's punica ops as a peer, in a side
            environment with torch 2.8 (scripts/bench_ipex.sh)
  --all     all of the above
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence

from benchmarks import common


def _vllm_python() -> str | None:
    """An interpreter that has vLLM: this one, else the vLLM environment."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = pathlib.Path(os.environ.get("VLLM_CPU_LORA_VLLM_VENV", ".venv-vllm"))
    python = venv / "bin" / "python"
    return str(python) if python.exists() else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument("--layer", action="store_true")
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--ipex", action="store_true")
    parser.add_argument("--all", action="store_true")
    parser.add_argument(
        "--no-kernels", action="store_true", help="skip the kernel part"
    )
    common.out_argument(parser)
    args = parser.parse_args(argv)
    out = args.out or common.default_out_dir(args.quick)
    common_args = ["--out", str(out)] + (["--quick"] if args.quick else [])
    status = 0

    if not args.no_kernels:
        from benchmarks import kernels

        status |= kernels.main(common_args)
    if args.layer or args.all:
        from benchmarks import fused_calls, layer

        status |= layer.main(common_args)
        status |= fused_calls.main(common_args)
    if args.vllm or args.all:
        python = _vllm_python()
        if python is None:
            print(
                "--vllm: no CPU vLLM here; scripts/setup_vllm_env.sh makes "
                "the environment (.venv-vllm) this part runs in",
                file=sys.stderr,
            )
            status |= 1
        else:
            cmd = [python, "-m", "benchmarks.vllm_e2e", *common_args]
            status |= subprocess.call(cmd)
    if args.ipex or args.all:
        script = pathlib.Path("scripts") / "bench_ipex.sh"
        if not script.exists():
            print(
                "--ipex: run from the repository's root (needs "
                "scripts/bench_ipex.sh, which makes the torch 2.8 side "
                "environment)",
                file=sys.stderr,
            )
            status |= 1
        else:
            status |= subprocess.call(["bash", str(script), *common_args])
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
