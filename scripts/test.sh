#!/usr/bin/env bash
# The README's test command: set up (scripts/setup_env.sh), then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q tests "$@"
