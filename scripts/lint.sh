#!/usr/bin/env bash
# Style checks CI runs: ruff (lint and format) and mypy (types of
# vllm_cpu_lora/) on the Python, clang-format on the C++ (.clang-format).
# Needs .venv (scripts/setup_env.sh installs ruff and mypy); installs
# Debian's clang-format when it is missing and this runs as root.
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # the runtime package, as [tool.mypy] in pyproject.toml says
if ! command -v clang-format >/dev/null; then
  [[ "$(id -u)" == 0 ]] || { echo "lint: clang-format is missing" >&2; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang-format >/dev/null
fi
clang-format --dry-run -Werror csrc/cpu/*.cpp csrc/cpu/*.h
echo "lint: clean"
