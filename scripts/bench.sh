#!/usr/bin/env bash
# The README's main command: set up (scripts/setup_env.sh), then run the
# kernel benchmark (ours vs vLLM's torch ops vs grouped torch vs the measured
# bound), print the table and write benchmarks/results/<cpu slug>/. Flags go to
# python -m benchmarks (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m benchmarks "$@"
