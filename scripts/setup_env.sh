#!/usr/bin/env bash
# Creates .venv (once) with the pinned CPU torch and the test/bench tools, then
# builds the extension in place against that torch (the C++ ABI must match
# the torch it runs with). Safe to rerun; a rerun rebuilds only what changed.
#
# Usage: scripts/setup_env.sh [--no-test-tools]
#   --no-test-tools  only what the build needs (the demo's set-up)
# VLLM_CPU_LORA_BUILD_ISAS chooses the ISA paths built (build_isas.py).
set -euo pipefail
cd "$(dirname "$0")/.."

tools=(pytest hypothesis expecttest numpy matplotlib tqdm ruff mypy==2.4.1)
if [[ "${1:-}" == --no-test-tools ]]; then
  tools=()
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

# Always pin torch: an unpinned torch pulls a multi-GB CUDA build. mypy is
# pinned (as in pyproject.toml's test extras): a new release finds new errors.
pip install -q -c constraints.txt torch setuptools wheel ninja "${tools[@]}"
# Built in place, incrementally (ninja, objects in build/): pip's editable
# install would rebuild everything in a temporary directory on every run.
# A .pth file puts the checkout on the venv's path instead.
python setup.py -q build_ext --inplace
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pwd >"$site/vllm_cpu_lora_checkout.pth"
python -c "import vllm_cpu_lora as v; print('vllm_cpu_lora built; ISA paths:', v.supported_isas())"
