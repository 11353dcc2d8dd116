#!/usr/bin/env bash
# Creates (once) the environment for vLLM on CPU with this package's plug-in:
# $VLLM_CPU_LORA_VLLM_VENV (default .venv-vllm in the repository) with the
# pinned CPU torch, a CPU build of vLLM (scripts/install_vllm_cpu.sh: from
# the wheel it keeps in ~/.cache/vllm-cpu-lora, built first if there is none,
# which takes 30-80 minutes on 2 cores) and this package, built by
# scripts/setup_env.sh in .venv (the same torch) and installed as a wheel.
# Prints the environment's directory on its last line. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${VLLM_CPU_LORA_VLLM_VENV:-.venv-vllm}"
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# Always pin torch: an unpinned torch pulls a multi-GB CUDA build.
"$venv/bin/pip" install -q "torch==2.13.0" >&2
scripts/install_vllm_cpu.sh "$venv" >&2
# This package as a wheel made from .venv's build (objects reused: seconds),
# so that vLLM finds its entry point; then the extras' dependencies.
scripts/setup_env.sh >&2
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
.venv/bin/pip wheel -q --no-build-isolation --no-deps -w "$wheels" . >&2
wheel="$(find "$wheels" -name 'vllm_cpu_lora-*.whl')"
"$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel" >&2
"$venv/bin/pip" install -q -c <(echo "torch==2.13.0") "$wheel[e2e,test,bench]" >&2
"$venv/bin/python" - <<'PY' >&2
import importlib

for name in ("vllm", "transformers", "peft", "tokenizers", "vllm_cpu_lora"):
    importlib.import_module(name)
PY
echo "$venv"
