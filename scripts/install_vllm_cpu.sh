#!/usr/bin/env bash
# Build (once) and install a CPU build of vLLM into a Python environment.
#
# Usage: scripts/install_vllm_cpu.sh [PYTHON | VENV_DIR]
#
#   PYTHON    the interpreter of the environment to install into; a virtual
#             environment's directory works too. Default: `python` on PATH.
#
# vLLM's PyPI wheel is a CUDA build; a CPU build has to be compiled from the
# source distribution. This script needs nothing but the package registries
# (PyPI, and Debian for oneDNN's source, which vLLM would otherwise clone
# from GitHub). The first run builds a wheel (30-80 minutes on 2 cores: 79
# measured while other jobs competed for them) and keeps it in the cache;
# later runs only install it (1-3 minutes).
# Running it again on an environment it already installed returns at once.
#
# Environment:
#   VLLM_CPU_LORA_CACHE    cache directory, kept outside the repository
#                          (default: ~/.cache/vllm-cpu-lora)
#   VLLM_CPU_LORA_JOBS     parallel compile jobs (default: number of CPUs)
#   VLLM_CPU_LORA_ALL_ISAS 1: build vLLM's three x86 extensions (AMX/AVX512-
#                          BF16, AVX512, AVX2) instead of only the one this
#                          CPU loads; makes the wheel portable, the build
#                          longer
#   VLLM_CPU_LORA_KEEP_BUILD 1: keep the build tree after a successful build
#
# Only vLLM 0.33.0 with torch 2.13.0 (CPU) has been tested: the two source
# patches below are specific to it.
set -euo pipefail

readonly VLLM_VERSION=0.33.0
readonly TORCH_VERSION=2.13.0
# numba is in vLLM's requirements/cpu.txt, which also pins torch 2.14.0+cpu,
# torchaudio, torchvision, ... that a LoRA serving path does not need.
readonly NUMBA_REQ="numba==0.65.0"
readonly ONEDNN_DEB_VERSION=3.7.2+ds-2
readonly BUILD_MINUTES="30-80"

CACHE="${VLLM_CPU_LORA_CACHE:-$HOME/.cache/vllm-cpu-lora}"
SCRIPT_START=$(date +%s)

log() { printf '[install_vllm_cpu %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}
elapsed() { echo "$(($(date +%s) - $1))s"; }

usage() {
  sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

case "${1:-}" in
  -h | --help) usage 0 ;;
esac
[[ $# -le 1 ]] || usage 2

# --- The target environment -------------------------------------------------
PY_ARG="${1:-python}"
if [[ -d "$PY_ARG" ]]; then
  PY_ARG="$PY_ARG/bin/python"
fi
command -v "$PY_ARG" >/dev/null 2>&1 || die "no Python interpreter '$PY_ARG'"
PY="$("$PY_ARG" -c 'import sys; print(sys.executable)')"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
  die "$PY is older than Python 3.10"
PREFIX="$("$PY" -c 'import sys; print(sys.prefix)')"
if [[ "$PREFIX" == "$("$PY" -c 'import sys; print(sys.base_prefix)')" ]]; then
  log "warning: $PY is not a virtual environment; installing into it anyway"
fi
BIN="$(dirname "$PY")"
# pip's cmake (>= 3.26, which vLLM needs) and ninja come before the system's.
export PATH="$BIN:$PATH"
PIP=("$PY" -m pip)
"${PIP[@]}" --version >/dev/null 2>&1 || die "pip is missing in $PREFIX"

CONSTRAINTS="$CACHE/constraints.txt"
mkdir -p "$CACHE/downloads"
# Every pip call keeps the CPU torch: an unpinned resolver would replace it
# with PyPI's multi-GB CUDA build (or vLLM's 2.14.0 pin).
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

PY_TAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
STAMP="$PREFIX/.vllm-cpu-lora-installed"
STAMP_TEXT="vllm==$VLLM_VERSION (cpu) torch==$TORCH_VERSION"

already_installed() {
  [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]] || return 1
  "$PY" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
import sys

# "+cpu" in the version is how vLLM recognises its CPU build at run time.
assert md.version("vllm") == sys.argv[1] + "+cpu"
files = [str(f) for f in md.files("vllm") or ()]
# A CPU build has vllm/_C*.so and none of the CUDA-only extensions.
assert any(f.startswith("vllm/_C") and f.endswith(".so") for f in files)
assert not any(f.startswith("vllm/_moe_C") for f in files)
EOF
}

if already_installed; then
  log "vLLM $VLLM_VERSION (CPU) is already installed in $PREFIX; nothing to do"
  exit 0
fi
rm -f "$STAMP"

# --- torch ------------------------------------------------------------------
torch_version() {
  "$PY" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null || true
}
TV="$(torch_version)"
if [[ -z "$TV" ]]; then
  log "installing torch==$TORCH_VERSION into $PREFIX"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION"
  TV="$(torch_version)"
fi
[[ "${TV%%+*}" == "$TORCH_VERSION" ]] ||
  die "$PREFIX has torch $TV; this script needs torch==$TORCH_VERSION"
"$PY" -W ignore -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' ||
  log "warning: torch $TV is a CUDA build; a CPU build is expected"

# Which of vLLM's x86 extensions this CPU loads (vllm/platforms/cpu.py,
# CpuPlatform.import_kernels makes the same choice).
ISA="$("$PY" -W ignore - <<'EOF'
import platform

import torch

if platform.machine() not in ("x86_64", "AMD64"):
    print("_C")
elif torch.cpu._is_avx512_supported():
    print("_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512")
else:
    print("_C_AVX2")
EOF
)"
if [[ "${VLLM_CPU_LORA_ALL_ISAS:-0}" == 1 ]]; then
  EXTENSIONS="all"
else
  EXTENSIONS="$ISA"
fi
WHEEL_DIR="$CACHE/wheels/vllm-$VLLM_VERSION-torch$TORCH_VERSION-$PY_TAG-$(uname -m)-$EXTENSIONS"
if [[ "$EXTENSIONS" != all && ! -d "$WHEEL_DIR" &&
  -d "${WHEEL_DIR%-*}-all" ]]; then
  WHEEL_DIR="${WHEEL_DIR%-*}-all"
fi

# --- Build the wheel (once) -------------------------------------------------
need_root() {
  [[ "$(id -u)" == 0 ]] || die "$* needs root (apt-get); run as root or do it by hand first"
}

fetch_onednn() {
  # Debian trixie's onednn source package: vLLM's CMake would clone oneDNN
  # from GitHub, which only a registry-only machine cannot reach. A private
  # sources list keeps the system's apt configuration untouched.
  local orig
  orig="$(find "$CACHE/downloads" -maxdepth 1 -name 'onednn_*.orig.tar.*' | sort | tail -n 1)"
  if [[ -n "$orig" ]]; then
    echo "$orig"
    return
  fi
  need_root "downloading oneDNN's Debian source package"
  local apt_dir="$CACHE/apt" mirror keyring t
  t=$(date +%s)
  mirror="$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)\/\{0,1\} *$/\1/p' \
    /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)"
  if [[ -z "$mirror" ]]; then
    mirror="$(sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\(http[^ ]*\/debian\)\/\{0,1\} .*/\2/p' \
      /etc/apt/sources.list 2>/dev/null | head -n 1)"
  fi
  mirror="${mirror:-http://deb.debian.org/debian}"
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  [[ -f "$keyring" ]] || die "missing $keyring (package debian-archive-keyring)"
  rm -rf "$apt_dir"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/src"
  echo "deb-src [signed-by=$keyring] $mirror trixie main" >"$apt_dir/sources.list"
  local apt_opts=(
    -o "Dir::Etc::sourcelist=$apt_dir/sources.list"
    -o "Dir::Etc::sourceparts=-"
    -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir/cache"
    -o "APT::Sandbox::User=root"
  )
  log "fetching oneDNN $ONEDNN_DEB_VERSION sources from $mirror (Debian trixie)"
  apt-get "${apt_opts[@]}" -q update >&2
  (cd "$apt_dir/src" &&
    { apt-get "${apt_opts[@]}" -q source --download-only "onednn=$ONEDNN_DEB_VERSION" >&2 ||
      { log "onednn=$ONEDNN_DEB_VERSION is gone from trixie; taking its current version" &&
        apt-get "${apt_opts[@]}" -q source --download-only onednn >&2; }; })
  orig="$(find "$apt_dir/src" -maxdepth 1 -name 'onednn_*.orig.tar.*' | sort | tail -n 1)"
  [[ -n "$orig" ]] || die "apt-get source onednn gave no orig tarball"
  mv "$orig" "$CACHE/downloads/"
  rm -rf "$apt_dir"
  log "oneDNN sources fetched in $(elapsed "$t")"
  echo "$CACHE/downloads/$(basename "$orig")"
}

build_wheel() {
  local t build_dir src log_file onednn_tar onednn_src jobs
  build_dir="$CACHE/build"
  log_file="$build_dir/build.log"
  mkdir -p "$build_dir"

  if ! dpkg -s libnuma-dev >/dev/null 2>&1; then
    need_root "installing libnuma-dev"
    log "installing libnuma-dev (NUMA headers vLLM's CPU extension needs)"
    apt-get -q update >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libnuma-dev >&2
  fi
  command -v g++ >/dev/null 2>&1 || die "g++ is missing (apt-get install g++)"

  t=$(date +%s)
  log "installing build requirements into $PREFIX"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" numpy ninja pybind11 \
    "setuptools>=77,<81" wheel packaging setuptools_scm setuptools-rust \
    "cmake>=3.26" jinja2
  log "build requirements ready in $(elapsed "$t")"

  local sdist="$CACHE/downloads/vllm-$VLLM_VERSION.tar.gz"
  if [[ ! -f "$sdist" ]]; then
    t=$(date +%s)
    log "downloading vLLM $VLLM_VERSION's source distribution from PyPI"
    # VLLM_VERSION_OVERRIDE: with VLLM_TARGET_DEVICE=cpu the metadata says
    # 0.33.0+cpu, which pip rejects as not matching vllm==0.33.0.
    VLLM_TARGET_DEVICE=cpu VLLM_VERSION_OVERRIDE="$VLLM_VERSION" \
      "${PIP[@]}" download -q --no-deps --no-binary :all: --no-build-isolation \
      -d "$CACHE/downloads" "vllm==$VLLM_VERSION"
    [[ -f "$sdist" ]] || die "pip download did not leave $sdist"
    log "source distribution downloaded in $(elapsed "$t")"
  fi

  onednn_tar="$(fetch_onednn)"

  src="$build_dir/vllm-$VLLM_VERSION"
  if [[ ! -f "$src/.unpacked" ]]; then
    rm -rf "$src"
    tar -xzf "$sdist" -C "$build_dir"
    touch "$src/.unpacked"
  fi
  onednn_src="$build_dir/onednn"
  if [[ ! -f "$onednn_src/.unpacked" ]]; then
    rm -rf "$onednn_src"
    mkdir -p "$onednn_src"
    tar -xf "$onednn_tar" -C "$onednn_src" --strip-components=1
    touch "$onednn_src/.unpacked"
  fi

  # Patch 1: vLLM refuses gcc < 12.3 on x86; Debian bookworm has 12.2, which
  # builds and serves correctly with patch 2.
  sed -i 's/CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12\.3))/CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.2))/' \
    "$src/cmake/cpu_extension.cmake"
  grep -q 'VERSION_GREATER_EQUAL 12.2))' "$src/cmake/cpu_extension.cmake" ||
    die "patch 1 (gcc version check) did not apply"
  # Patch 2: gcc 12.2 has an internal compiler error (lookup_template_class_1)
  # on a local `constexpr` array bound used in a lambda; `static constexpr`
  # means the same and compiles.
  sed -i 's/^\( *\)constexpr int64_t kBLOCK_H_MAX = 16;/\1static constexpr int64_t kBLOCK_H_MAX = 16;/' \
    "$src/csrc/cpu/sgl-kernels/flash_mla.cpp"
  grep -q 'static constexpr int64_t kBLOCK_H_MAX = 16;' \
    "$src/csrc/cpu/sgl-kernels/flash_mla.cpp" ||
    die "patch 2 (flash_mla.cpp) did not apply"
  # Patch 3 (build time only): on x86 vLLM builds three variants of its
  # extension and loads one, chosen by the CPU's ISA; build only that one.
  if [[ "$EXTENSIONS" != all ]]; then
    local ext
    for ext in _C _C_AVX512 _C_AVX2; do
      if [[ "$ext" != "$ISA" ]]; then
        sed -i "/ext_modules.append(CMakeExtension(name=\"vllm\.$ext\"))/d" "$src/setup.py"
      fi
    done
    grep -q "CMakeExtension(name=\"vllm\.$ISA\")" "$src/setup.py" ||
      die "patch 3 (extension selection) lost vllm.$ISA"
    log "building only vllm.$ISA, the extension this CPU loads" \
      "(VLLM_CPU_LORA_ALL_ISAS=1 builds all three)"
  fi

  # No VLLM_VERSION_OVERRIDE here: the wheel must be version X+cpu, which is
  # how vLLM's platform detection recognises a CPU build (without it vLLM
  # needs VLLM_TARGET_DEVICE=cpu in the environment at run time).
  jobs="${VLLM_CPU_LORA_JOBS:-$(nproc)}"
  log "building vLLM $VLLM_VERSION for CPU with $jobs jobs: this takes about" \
    "$BUILD_MINUTES minutes on 2 cores (oneDNN is most of it); log: $log_file"
  t=$(date +%s)
  rm -rf "$build_dir/wheel"
  (
    cd "$src"
    env -u VLLM_VERSION_OVERRIDE VLLM_TARGET_DEVICE=cpu \
      MAX_JOBS="$jobs" CARGO_NET_OFFLINE=true \
      FETCHCONTENT_SOURCE_DIR_ONEDNN="$onednn_src" \
      "${PIP[@]}" wheel -v --no-build-isolation --no-deps \
      -w "$build_dir/wheel" . >"$log_file" 2>&1
  ) &
  local pid=$! last=""
  while kill -0 "$pid" 2>/dev/null; do
    sleep 60
    local step
    step="$(grep -o '^ *\[[0-9]*/[0-9]*\]' "$log_file" 2>/dev/null |
      tail -n 1 | tr -d ' ' || true)"
    if [[ -n "$step" && "$step" != "$last" ]]; then
      log "  ... $(elapsed "$t") in, ninja step $step"
      last="$step"
    fi
  done
  if ! wait "$pid"; then
    tail -n 60 "$log_file" >&2
    die "the build failed after $(elapsed "$t"); full log: $log_file" \
      "(running this script again resumes it)"
  fi
  log "vLLM built in $(elapsed "$t")"

  local wheel
  wheel="$(find "$build_dir/wheel" -maxdepth 1 -name "vllm-$VLLM_VERSION+cpu-*.whl" | head -n 1)"
  [[ -n "$wheel" ]] || die "the build left no wheel in $build_dir/wheel"
  rm -rf "$WHEEL_DIR.tmp"
  mkdir -p "$WHEEL_DIR.tmp"
  mv "$wheel" "$WHEEL_DIR.tmp/"
  cp "$src/requirements/common.txt" "$WHEEL_DIR.tmp/requirements-common.txt"
  rm -rf "$WHEEL_DIR"
  mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
  if [[ "${VLLM_CPU_LORA_KEEP_BUILD:-0}" != 1 ]]; then
    rm -rf "$build_dir"
  fi
  log "cached the wheel in $WHEEL_DIR"
}

if [[ -d "$WHEEL_DIR" ]] &&
  [[ -z "$(find "$WHEEL_DIR" -maxdepth 1 -name "vllm-$VLLM_VERSION+cpu-*.whl")" ]]; then
  log "no vllm-$VLLM_VERSION+cpu wheel in $WHEEL_DIR; removing it and building anew"
  rm -rf "$WHEEL_DIR"
fi
if [[ ! -d "$WHEEL_DIR" ]]; then
  build_wheel
else
  log "using the cached wheel in $WHEEL_DIR"
fi

# --- Install ----------------------------------------------------------------
WHEEL="$(find "$WHEEL_DIR" -maxdepth 1 -name "vllm-$VLLM_VERSION+cpu-*.whl" | head -n 1)"
[[ -n "$WHEEL" ]] || die "no wheel in $WHEEL_DIR; remove that directory and run again"
T=$(date +%s)
log "installing $(basename "$WHEEL") and vLLM's requirements into $PREFIX"
# --no-deps: the wheel's metadata pins torch 2.14.0+cpu, torchaudio,
# torchvision, torchcodec and intel-openmp; torch 2.13.0 serves fine and the
# rest is not needed for text generation. `pip check` reports them, harmlessly.
"${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL"
log "(pip may now say that vllm wants torch 2.14.0+cpu, torchaudio, ...: expected, see above)"
"${PIP[@]}" install -q -c "$CONSTRAINTS" \
  -r "$WHEEL_DIR/requirements-common.txt" "$NUMBA_REQ"
"$PY" -c 'import vllm, vllm.platforms as p; assert p.current_platform.is_cpu(), p.current_platform' ||
  die "vLLM was installed but does not see a CPU platform"
echo "$STAMP_TEXT" >"$STAMP"
log "installed in $(elapsed "$T"); total $(elapsed "$SCRIPT_START")"
