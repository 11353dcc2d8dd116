#!/usr/bin/env bash
# The Arm paths, tested on this x86-64 machine: cross-builds the extension for
# aarch64 against PyPI's aarch64 torch wheel and runs a subset of the kernel
# tests (scripts/arm/tests.txt) under qemu-user on `-cpu max`, every path
# (BF16: neon_bf16, neon, scalar), then the detection tests on `-cpu
# cortex-a72` (no BF16: detection must fall back to neon). Emulated speed
# means nothing; on a real Arm host run scripts/test.sh and `python -m
# benchmarks` instead.
#
# Needs no root: Debian's cross compiler, qemu-user-static and an arm64
# CPython (with its libraries) are downloaded with apt-get into a private
# state directory and unpacked with dpkg-deb; the wheels come from PyPI with
# pip. All of it is cached in $VLLM_CPU_LORA_ARM_CACHE (default
# ~/.cache/vllm-cpu-lora/arm), about 2 GB; a rerun downloads nothing and
# rebuilds only what changed. No binfmt handler is needed: qemu is called
# directly, so tests that start a child Python are left out.
#
# Usage: scripts/test_arm.sh [--cpu MODEL] [PYTEST_ARGS...]
#   --cpu MODEL   only this qemu CPU model (default: max, then cortex-a72)
#   PYTEST_ARGS   instead of the tests above, e.g. tests/test_ops.py -k exact
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
cache=${VLLM_CPU_LORA_ARM_CACHE:-$HOME/.cache/vllm-cpu-lora/arm}
python=${PYTHON:-python3}  # Host Python with pip: downloads, stub generator.
start=$SECONDS
say() { echo "== test_arm: $* ($((SECONDS - start)) s)"; }

cpus=(max cortex-a72)
if [ "${1:-}" = "--cpu" ]; then
  cpus=("$2")
  shift 2
fi

# Debian packages for ARCH (and their dependencies) unpacked into DEST, once
# per package list. The amd64 tools are resolved against this machine's
# dpkg status, so only what it lacks is fetched; the arm64 root against an
# empty one, so it is complete.
debs() {
  local arch=$1 status=$2 dest=$3
  shift 3
  local stamp="$dest/.packages" dir="$cache/apt-$arch"
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$*" ] && return
  mkdir -p "$dir/lists/partial" "$dir/archives/partial" "$dir/parts"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  local deb="deb [arch=$arch signed-by=$keyring] http://deb.debian.org/debian"
  cat >"$dir/sources.list" <<EOF
$deb bookworm main
$deb bookworm-updates main
deb [arch=$arch signed-by=$keyring] http://deb.debian.org/debian-security bookworm-security main
EOF
  [ "$status" = empty ] && status="$dir/status" && : >"$status"
  local opts=(
    -o "APT::Architecture=$arch" -o "APT::Architectures::=$arch"
    -o "Dir::Etc::SourceList=$dir/sources.list"
    -o "Dir::Etc::SourceParts=$dir/parts" -o "Dir::Etc::Preferences=/dev/null"
    -o "Dir::Etc::PreferencesParts=$dir/parts"
    -o "Dir::State::Lists=$dir/lists" -o "Dir::State::status=$status"
    -o "Dir::Cache=$dir" -o "Dir::Cache::Archives=$dir/archives"
    -o Debug::NoLocking=1 -o "APT::Sandbox::User=$(id -un)"
  )
  apt-get -q "${opts[@]}" update >/dev/null
  rm -f "$dir"/archives/*.deb
  apt-get -q -y --no-install-recommends "${opts[@]}" install --download-only \
    "$@" >/dev/null
  rm -rf "$dest"
  mkdir -p "$dest"
  for f in "$dir"/archives/*.deb; do dpkg-deb -x "$f" "$dest"; done
  echo "$*" >"$stamp"
}

say "Debian packages"
tools=$cache/tools
debs amd64 /var/lib/dpkg/status "$tools" g++-12-aarch64-linux-gnu \
  qemu-user-static
sysroot=$cache/sysroot
debs arm64 empty "$sysroot" python3.11 libpython3.11-dev libstdc++6 libgomp1
# The cross tools' own libraries (binutils') that this machine lacks.
export LD_LIBRARY_PATH=$tools/usr/lib/x86_64-linux-gnu
cross=$tools/usr/bin/aarch64-linux-gnu-
export READELF=${cross}readelf
qemu=$tools/usr/bin/qemu-aarch64-static

# qemu-user passes /proc and /sys through from the host, whose x86
# /proc/cpuinfo makes torch's cpuinfo crash; paths under -L's root come
# first, so the root gets an Arm one, and the MIDR oneDNN asks for
# (Neoverse N1's ids, this machine's CPU count). Which features the CPU has
# is told by HWCAP, from -cpu.
mkdir -p "$sysroot/proc"
for ((i = 0; i < $(nproc); i++)); do
  printf 'processor\t: %d\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n' "$i"
  printf 'CPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0c\n'
  printf 'CPU revision\t: 1\n\n'
  midr=$sysroot/sys/devices/system/cpu/cpu$i/regs/identification/midr_el1
  mkdir -p "$(dirname "$midr")"
  echo 0x00000000414fd0c1 >"$midr"
done >"$sysroot/proc/cpuinfo"

say "aarch64 wheels"
site=$cache/site
stubs=$cache/cuda-stubs  # Made from the wheel: made again with it.
wheels=(torch==2.13.0 numpy==2.4.6 filelock==4.3.1 typing_extensions==4.16.0
  sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1 jinja2==3.1.6 markupsafe==3.0.4
  fsspec==2026.9.0 pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0
  packaging==26.4 pygments==2.21.0 hypothesis==6.155.7
  sortedcontainers==2.4.0)
if [ "$(cat "$site/.wheels" 2>/dev/null)" != "${wheels[*]}" ]; then
  rm -rf "$site" "$stubs"
  # --no-deps: pip would judge torch's CUDA requirements by this machine.
  "$python" -m pip install -q --root-user-action=ignore --no-deps \
    --only-binary=:all: --target "$site" --platform manylinux_2_28_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 "${wheels[@]}"
  echo "${wheels[*]}" >"$site/.wheels"
fi

if [ ! -f "$stubs/.done" ]; then
  say "CUDA stand-ins"
  "$python" scripts/arm/cuda_stubs.py "$site/torch/lib" "$sysroot" "$stubs" \
    "${cross}gcc-12 --sysroot=$tools"
  touch "$stubs/.done"
fi

say "cross-building vllm_cpu_lora/_C for aarch64"
make -s -j"${MAX_JOBS:-$(nproc)}" -f scripts/arm/Makefile \
  CXX="${cross}g++-12 --sysroot=$tools" \
  TORCH="$site/torch" SYSROOT="$sysroot" STUBS="$stubs" \
  OUT="$cache/build" SO=vllm_cpu_lora/_C.cpython-311-aarch64-linux-gnu.so

# CPython under qemu, the checkout and the wheels on its path.
arm_python() {
  local cpu=$1
  shift
  env PYTHONPATH="$repo:$site" LD_LIBRARY_PATH="$stubs" \
    "$qemu" -cpu "$cpu" -L "$sysroot" \
    "$sysroot/usr/bin/python3.11" "$@"
}

# What detection must find on each model, and what runs there: the subset
# on -cpu max, whose paths are all of them, then the bad-input table once
# per path the CPU has (forced with VLLM_CPU_LORA_ISA: its checks must hold
# whatever kernel a path has); on cortex-a72 (no BF16) the detection tests,
# since its paths' code is what max runs too. All in pytest's process: each
# start of torch under qemu takes minutes.
declare -A want=([max]="neon_bf16 neon scalar" [cortex-a72]="neon scalar")
mapfile -t subset < <(grep -v -e '^#' -e '^$' scripts/arm/tests.txt)
for cpu in "${cpus[@]}"; do
  say "qemu -cpu $cpu"
  table=no
  if [ $# -gt 0 ]; then
    tests=("$@")
  elif [ "$cpu" = cortex-a72 ]; then
    tests=(tests/test_isa.py)
  else
    tests=("${subset[@]}")
    table=yes
  fi
  arm_python "$cpu" - "${want[$cpu]:-}" "$table" "${tests[@]}" <<'EOF'
import os
import sys

import pytest

import vllm_cpu_lora

want, table, tests = sys.argv[1], sys.argv[2] == "yes", sys.argv[3:]
got = " ".join(vllm_cpu_lora.supported_isas())
print("ISA paths:", got)
if want and got != want:
    sys.exit(f"test_arm: expected {want}")
args = ["-q", "-p", "no:cacheprovider"]
status = pytest.main([*args, *tests])
for path in vllm_cpu_lora.supported_isas() if table else []:
    if status != 0:
        break
    os.environ["VLLM_CPU_LORA_ISA"] = path
    print(f"Bad-input table on {vllm_cpu_lora.isa()}:", flush=True)
    # Its run in a child Python would need a binfmt handler for qemu.
    status = pytest.main([*args, "tests/test_bad_inputs.py", "--deselect",
                          "tests/test_bad_inputs.py::test_table_in_subprocess"])
sys.exit(status)
EOF
done
say "Arm paths passed"
