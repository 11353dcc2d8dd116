#!/usr/bin/env bash
# On a machine with AMX: set up and build (scripts/setup_env.sh), run the AMX
# tests for real (every op against the torch reference on the "amx" path, and
# the emulated tiles), then print the AMX vs AVX512-BF16 vs reference table
# and write it to benchmarks/results/<cpu slug>/amx.md.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "AMX flags in /proc/cpuinfo: $(grep -m1 -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python - <<'PY'
import sys
import vllm_cpu_lora
if "amx" not in vllm_cpu_lora.supported_isas():
    sys.exit(f"no AMX here (paths: {vllm_cpu_lora.supported_isas()})")
print("AMX path available:", vllm_cpu_lora.supported_isas())
PY
python -m pytest -q tests/test_ops.py -k "amx"
python -m benchmarks.bench_amx "$@"
