#!/usr/bin/env bash
# The README's main command: CPU vLLM serving a tiny local Llama with two
# LoRA adapters and without one through this package's kernels, printing
# each request's output and tokens/s (python -m vllm_cpu_lora.demo; flags go
# to it, e.g. --compare to run vLLM's own torch ops too and compare tokens).
#
# Sets up first (scripts/setup_vllm_env.sh): without a cached CPU build of
# vLLM that means building one, 30-80 minutes on 2 cores, once.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="$(scripts/setup_vllm_env.sh | tail -n 1)"
"$venv/bin/python" -m vllm_cpu_lora.demo "$@"
