#!/usr/bin/env bash
# The vLLM integration tests (tests/test_punica_wrapper.py,
# tests/test_vllm_e2e.py, tests/test_vllm_tp.py, tests/test_vllm_serve.py,
# tests/test_vllm_soak.py, tests/test_vllm_bad_requests.py,
# tests/test_vllm_adapters_work.py, tests/test_vllm_compiled.py,
# tests/test_vllm_crash.py) in an
# environment with CPU vLLM
# (scripts/setup_vllm_env.sh).
#
# Usage: scripts/test_vllm.sh [--from-source VERSION] [PYTEST_ARGS...]
#
# Unlike scripts/test.sh, a missing vLLM is an error here, and so is any
# skipped test.
set -euo pipefail
cd "$(dirname "$0")/.."

route=()
if [[ "${1:-}" == --from-source ]]; then
  route=("$1" "${2:?--from-source needs a version}")
  shift 2
fi
venv="$(scripts/setup_vllm_env.sh "${route[@]}" | tail -n 1)"

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
"$venv/bin/python" -m pytest -q -rs tests/test_punica_wrapper.py \
  tests/test_vllm_e2e.py tests/test_vllm_tp.py tests/test_vllm_serve.py \
  tests/test_vllm_soak.py tests/test_vllm_bad_requests.py \
  tests/test_vllm_adapters_work.py tests/test_vllm_compiled.py \
  tests/test_vllm_crash.py "$@" 2>&1 |
  tee "$log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
if tail -n 3 "$log" | grep -q "skipped"; then
  echo "scripts/test_vllm.sh: tests were skipped; they must run here" >&2
  exit 1
fi
