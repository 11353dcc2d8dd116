#!/usr/bin/env bash
# Builds an ASan + UBSan copy of the extension and runs the test suite on it.
#
# The in-tree build is not touched: the working tree (tracked files and
# untracked files git does not ignore) is copied into a build directory, the
# extension is built there with VLLM_CPU_LORA_SANITIZE=1 (setup.py then uses
# -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined), and
# pytest runs the copy's tests/ against the copy's package.
#
# Any sanitizer report fails the run: ASan and UBSan stop the process at the
# first error, and the output is searched for reports besides.
#
# Usage: scripts/sanitize.sh [BUILD_DIR] [-- PYTEST_ARGS...]
#   BUILD_DIR  where to build (default: a fresh temporary directory, removed
#              afterwards unless KEEP_BUILD=1).
#   REUSE_BUILD=1 runs the tests of an existing BUILD_DIR as it is (no copy,
#   no build). Python is $PYTHON, else the repo's .venv, else python3.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir=""
if [[ $# -gt 0 && "$1" != "--" ]]; then
  build_dir="$1"
  shift
fi
if [[ $# -gt 0 && "$1" == "--" ]]; then
  shift
fi
pytest_args=("$@")

if [[ -n "${PYTHON:-}" ]]; then
  python="${PYTHON}"
elif [[ -x "${repo}/.venv/bin/python" ]]; then
  python="${repo}/.venv/bin/python"
else
  python="python3"
fi
# ninja (used by torch's BuildExtension) is installed next to the venv's python.
PATH="$(dirname "${python}"):${PATH}"
export PATH

if [[ -z "${build_dir}" ]]; then
  if [[ "${REUSE_BUILD:-0}" == "1" ]]; then
    echo "sanitize: REUSE_BUILD=1 needs a BUILD_DIR" >&2
    exit 2
  fi
  build_dir="$(mktemp -d "${TMPDIR:-/tmp}/vllm_cpu_lora_sanitize.XXXXXX")"
  if [[ "${KEEP_BUILD:-0}" != "1" ]]; then
    trap 'rm -rf "${build_dir}"' EXIT
  fi
fi
mkdir -p "${build_dir}"
build_dir="$(cd "${build_dir}" && pwd)"

build() {
  # Copy the working tree, not a checkout of HEAD: uncommitted tests run too.
  (cd "${repo}" && git ls-files -z --cached --others --exclude-standard) |
    (cd "${repo}" && xargs -0 cp --parents -t "${build_dir}" --)
  # Never pick up an extension built elsewhere.
  find "${build_dir}" -name '_C*.so' -delete
  # Python's own compile flags include -fwrapv, which makes signed overflow
  # defined (it wraps) and so invisible to UBSan; -fno-wrapv (appended after
  # them via CFLAGS) lets UBSan report overflow in index and bounds
  # arithmetic.
  (cd "${build_dir}" &&
    VLLM_CPU_LORA_SANITIZE=1 MAX_JOBS="$(nproc)" CFLAGS="-fno-wrapv" \
      "${python}" setup.py build_ext --inplace >build.log 2>&1) || {
    tail -50 "${build_dir}/build.log"
    echo "sanitize: build failed" >&2
    exit 1
  }
}

start=$(date +%s)
if [[ "${REUSE_BUILD:-0}" == "1" ]]; then
  echo "sanitize: reusing the build in ${build_dir}"
else
  echo "sanitize: building in ${build_dir}"
  build
fi
built=$(date +%s)
echo "sanitize: build took $((built - start)) s"

libasan="$(gcc -print-file-name=libasan.so)"
# Python does not link libstdc++: unless it is loaded with ASan, ASan's
# __cxa_throw interceptor finds no real __cxa_throw and aborts on the first
# C++ exception (every TORCH_CHECK failure).
libstdcxx="$(gcc -print-file-name=libstdc++.so.6)"
for lib in "${libasan}" "${libstdcxx}"; do
  if [[ ! -e "${lib}" ]]; then
    echo "sanitize: ${lib} not found (gcc -print-file-name)" >&2
    exit 1
  fi
done

export LD_PRELOAD="${libasan} ${libstdcxx}"
# Python and torch leak by design at exit, so leak detection is off.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
# Output must survive a process the sanitizers stop: unbuffered Python, and
# pytest capturing only Python-level output (--capture=sys), so reports
# written to file descriptor 2 reach the log.
export PYTHONUNBUFFERED=1
export PYTHONPATH="${build_dir}${PYTHONPATH:+:${PYTHONPATH}}"
# Lets tests skip what cannot run here: RSS budgets (ASan's quarantine and
# shadow memory inflate RSS) and calls known to be undefined behaviour.
export VLLM_CPU_LORA_SANITIZED=1

# Make sure the sanitized copy is what gets imported, not the in-tree build.
(cd "${build_dir}" && "${python}" - <<'EOF')
import os
import vllm_cpu_lora

path = os.path.realpath(vllm_cpu_lora._C.__file__)
assert path.startswith(os.path.realpath(os.getcwd())), path
print("sanitize: testing", path)
EOF

log="${build_dir}/sanitize.log"
status=0
(cd "${build_dir}" &&
  "${python}" -m pytest -p no:cacheprovider --capture=sys -q tests \
    "${pytest_args[@]}") 2>&1 | tee "${log}" || status=$?
done_at=$(date +%s)

# Also reports from child processes, which tests print when they fail.
if grep -qE 'ERROR: AddressSanitizer|runtime error:|SUMMARY: [A-Za-z]+Sanitizer' \
  "${log}"; then
  echo "sanitize: sanitizer report in ${log}" >&2
  status=1
fi
echo "sanitize: tests took $((done_at - built)) s, total $((done_at - start)) s"
if [[ ${status} -ne 0 ]]; then
  echo "sanitize: FAILED" >&2
else
  echo "sanitize: clean"
fi
exit "${status}"
