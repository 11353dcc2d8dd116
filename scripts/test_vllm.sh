#!/usr/bin/env bash
# The vLLM integration tests (tests/test_punica_wrapper.py,
# tests/test_vllm_e2e.py) in their own environment, with a CPU build of vLLM.
#
# Usage: scripts/test_vllm.sh [PYTEST_ARGS...]
#
# The environment comes from scripts/setup_vllm_env.sh (.venv-vllm; a first
# run builds CPU vLLM, 30-80 minutes on 2 cores, later runs take minutes).
# Unlike scripts/test.sh, a missing vLLM is an error here, and so is any
# skipped test.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="$(scripts/setup_vllm_env.sh | tail -n 1)"

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
"$venv/bin/python" -m pytest -q -rs tests/test_punica_wrapper.py \
  tests/test_vllm_e2e.py "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
if tail -n 3 "$log" | grep -q "skipped"; then
  echo "scripts/test_vllm.sh: tests were skipped; they must run here" >&2
  exit 1
fi
