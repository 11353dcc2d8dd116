#!/usr/bin/env bash
# Compare vllm_cpu_lora's kernels with Intel Extension for PyTorch's CPU
# punica ops (torch.ops.torch_ipex.punica_*) in one process.
#
# Usage: scripts/bench_ipex.sh [--quick] [--threads both|all|1] [--out DIR]
#
# IPEX 2.8 (the last release on PyPI) works only with torch 2.8, so this
# script:
#   1. creates (once) a side virtual environment with torch==2.8.0 and
#      intel-extension-for-pytorch==2.8.0 (torch always pinned);
#   2. builds vllm_cpu_lora against that torch from a copy of this checkout
#      (tracked and untracked, not ignored, files) kept in the cache, never
#      in the checkout, whose in-place extension belongs to the main .venv;
#      it installs with --no-deps, since our pyproject pins torch==2.13.0;
#   3. runs `python -P -m benchmarks.ipex` there, from the checkout
#      root, which writes ipex.md, ipex.json and ipex.png to
#      benchmarks/results/<cpu slug> (its quick subfolder with --quick).
# A step that cannot work here says why, writes that into ipex.md and
# ipex.json, and exits non-zero.
#
# Cost (measured on the 2-vCPU machine): PyPI's torch 2.8.0 Linux wheel is
# its CUDA build, and installing it without its nvidia-* dependencies does
# not work (`import torch` fails: libcudart.so.12 not found), so the side
# environment takes ~3.9 GB of downloads and ~7 GB of disk; the install
# takes 1-2 minutes, a build of ours 2-3 (skipped when the sources did not
# change), the full benchmark ~5. Where the PyTorch CPU index is reachable,
# PIP_INDEX_URL=https://download.pytorch.org/whl/cpu gives the small build.
#
# Environment:
#   VLLM_CPU_LORA_CACHE     cache directory (default ~/.cache/vllm-cpu-lora)
#   VLLM_CPU_LORA_IPEX_VENV side environment (default CACHE/ipex-venv)
#   PYTHON                  interpreter for it (default python3; >= 3.11)
#   VLLM_CPU_LORA_LOCK      lock file held around heavy steps, shared with
#                           the other benchmarks (default /tmp/vcl-heavy.lock;
#                           empty: no lock)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"

readonly TORCH_VERSION=2.8.0
readonly IPEX_VERSION=2.8.0
readonly MIN_FREE_GB=10

CACHE="${VLLM_CPU_LORA_CACHE:-$HOME/.cache/vllm-cpu-lora}"
VENV="${VLLM_CPU_LORA_IPEX_VENV:-$CACHE/ipex-venv}"
BUILD_ROOT="$CACHE/ipex-build"
LOCK="${VLLM_CPU_LORA_LOCK-/tmp/vcl-heavy.lock}"
PY="$VENV/bin/python"

log() { printf '[bench_ipex %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Runs a command while holding the shared lock for heavy jobs.
heavy() {
  if [[ -n "$LOCK" ]]; then
    flock "$LOCK" "$@"
  else
    "$@"
  fi
}

# --- Where results go (the Python module's rule: benchmarks.common) --------
OUT_DIR=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --quick) quick=1 ;;
    --out) OUT_DIR="${args[i + 1]:-}" ;;
    --out=*) OUT_DIR="${args[i]#--out=}" ;;
  esac
done
if [[ -z "$OUT_DIR" ]]; then
  OUT_DIR=$(python3 -m benchmarks.common ${quick:+--quick})
fi

# Prints why, records it as the result, and exits non-zero.
fail() {
  log "ERROR: $*"
  mkdir -p "$OUT_DIR"
  rm -f "$OUT_DIR/ipex.png"
  {
    echo "# Intel Extension for PyTorch's punica ops vs vllm_cpu_lora"
    echo
    echo "Not run ($(date -u +%Y-%m-%dT%H:%M:%SZ), scripts/bench_ipex.sh):"
    echo
    echo "$*"
  } >"$OUT_DIR/ipex.md"
  python3 - "$OUT_DIR/ipex.json" "$*" <<'EOF' || true
import json, sys
with open(sys.argv[1], "w") as f:
    json.dump({"ipex": {"available": False, "reason": sys.argv[2]}}, f)
EOF
  exit 1
}

# --- 1. The side environment -----------------------------------------------
STAMP="$VENV/.vcl-ipex-installed"
WANT_STAMP="torch==$TORCH_VERSION intel-extension-for-pytorch==$IPEX_VERSION"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT_STAMP" ]]; then
  python="${PYTHON:-python3}"
  command -v "$python" >/dev/null || fail "no Python interpreter '$python'"
  version_ok='import sys; sys.exit(not (3, 11) <= sys.version_info < (3, 14))'
  "$python" -c "$version_ok" ||
    fail "$python is not Python 3.11-3.13 (IPEX 2.8 has wheels for 3.9-3.13;" \
      "running from the checkout root needs -P, new in 3.11)"
  mkdir -p "$(dirname "$VENV")"
  free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR == 2 { print $4 }')
  ((free_kb >= MIN_FREE_GB * 1024 * 1024)) ||
    fail "only $((free_kb / 1024 / 1024)) GiB free under $(dirname "$VENV");" \
      "the side environment (a CUDA build of torch $TORCH_VERSION) needs" \
      "about $MIN_FREE_GB"
  log "creating $VENV (torch $TORCH_VERSION, IPEX $IPEX_VERSION;" \
    "~4 GB to download)"
  start=$(date +%s)
  rm -rf "$VENV"
  "$python" -m venv "$VENV"
  # Always pin torch: an unpinned torch pulls the newest (CUDA) release, and
  # IPEX 2.8 refuses any torch but 2.8. --no-cache-dir: ~4 GB not kept twice.
  heavy "$PY" -m pip install -q --no-cache-dir "torch==$TORCH_VERSION" \
    "intel-extension-for-pytorch==$IPEX_VERSION" \
    numpy matplotlib tqdm setuptools wheel ninja ||
    fail "pip could not install torch==$TORCH_VERSION and" \
      "intel-extension-for-pytorch==$IPEX_VERSION into $VENV (see above)"
  "$PY" -c 'import torch, intel_extension_for_pytorch' 2>/dev/null ||
    fail "torch $TORCH_VERSION + IPEX $IPEX_VERSION installed but do not" \
      "import: $("$PY" -c 'import intel_extension_for_pytorch' 2>&1 | tail -1)"
  echo "$WANT_STAMP" >"$STAMP"
  log "side environment ready in $(($(date +%s) - start)) s," \
    "$(du -sh "$VENV" | cut -f1) on disk"
fi
TORCH_BUILD=$("$PY" -c 'import torch; print(torch.__version__)')
log "side environment: $VENV (torch $TORCH_BUILD)"

# --- 2. Our package, built against torch 2.8 from a copy -------------------
# The working tree is staged on every run; the copy built from (SRC) takes
# only the files whose content changed, so its build tree stays and ninja
# recompiles only what they touch. No build at all when nothing changed.
STAGE="$BUILD_ROOT/stage"
SRC="$BUILD_ROOT/src"
rm -rf "$STAGE"
mkdir -p "$STAGE"
git ls-files -co --exclude-standard -z |
  while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done |
  tar --null -T - -cf - | tar -xf - -C "$STAGE"

# torch 2.8 has no at::cpu::get_cpu_capabilities() (torch 2.13 has), which
# csrc/cpu/bgmv_cpu.cpp uses for CPU feature detection. Where the torch
# lacks it, the copy detects with cpuinfo instead (the library behind it,
# exported by libc10 and shipped with every torch). Drop this once csrc does
# the same.
TORCH_DIR=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
TORCH_INCLUDE="$TORCH_DIR/include"
PATCHED=""
if grep -q get_cpu_capabilities "$STAGE/csrc/cpu/bgmv_cpu.cpp" &&
  ! grep -q get_cpu_capabilities "$TORCH_INCLUDE/ATen/cpu/Utils.h"; then
  patch -s -p1 -d "$STAGE" --no-backup-if-mismatch <<'EOF' ||
--- a/csrc/cpu/bgmv_cpu.cpp
+++ b/csrc/cpu/bgmv_cpu.cpp
@@ -10,6 +10,7 @@
 #include <ATen/MemoryOverlap.h>
 #include <ATen/Parallel.h>
 #include <ATen/cpu/Utils.h>
+#include <cpuinfo.h>
 #include <torch/library.h>
 
 #include <algorithm>
@@ -46,24 +47,25 @@
 
 const CpuFeatures& Features() {
   static const CpuFeatures features = [] {
-    const auto caps = at::cpu::get_cpu_capabilities();
-    auto has = [&](const char* key) {
-      const auto it = caps.find(key);
-      return it != caps.end() && it->second.isBool() && it->second.toBool();
-    };
-    const bool avx2 = has("avx2") && has("fma3") && has("f16c");
-    const bool avx512 = avx2 && has("avx512_f") && has("avx512_bw") &&
-                        has("avx512_vl") && has("avx512_dq");
+    // cpuinfo is what torch detects with (libc10 exports it, and every torch
+    // ships its header); at::cpu::get_cpu_capabilities() is recent.
+    const bool ok = cpuinfo_initialize();
+    const bool avx2 = ok && cpuinfo_has_x86_avx2() && cpuinfo_has_x86_fma3() &&
+                      cpuinfo_has_x86_f16c();
+    const bool avx512 = avx2 && cpuinfo_has_x86_avx512f() &&
+                        cpuinfo_has_x86_avx512bw() &&
+                        cpuinfo_has_x86_avx512vl() &&
+                        cpuinfo_has_x86_avx512dq();
     CpuFeatures f{};
     f.supported[static_cast<int>(Isa::kScalar)] = true;
     f.supported[static_cast<int>(Isa::kAvx2)] = avx2;
     f.supported[static_cast<int>(Isa::kAvx512)] = avx512;
-    const bool avx512_bf16 = avx512 && has("avx512_bf16");
+    const bool avx512_bf16 = avx512 && cpuinfo_has_x86_avx512bf16();
     f.supported[static_cast<int>(Isa::kAvx512Bf16)] = avx512_bf16;
     // AMX also needs the OS to grant tile state (arch_prctl, via torch).
-    f.supported[static_cast<int>(Isa::kAmx)] = avx512_bf16 && has("amx_bf16") &&
-                                               has("amx_tile") &&
-                                               at::cpu::init_amx();
+    f.supported[static_cast<int>(Isa::kAmx)] =
+        avx512_bf16 && cpuinfo_has_x86_amx_bf16() &&
+        cpuinfo_has_x86_amx_tile() && at::cpu::init_amx();
     f.supported[static_cast<int>(Isa::kAmxEmulated)] = avx512_bf16;
     return f;
   }();
EOF
    fail "csrc/cpu/bgmv_cpu.cpp uses at::cpu::get_cpu_capabilities()," \
      "which torch $TORCH_BUILD lacks, and the compatibility patch in" \
      "scripts/bench_ipex.sh no longer applies to it"
  PATCHED="; the copy detects CPU features with cpuinfo instead of"
  PATCHED+=" at::cpu::get_cpu_capabilities() (absent from torch 2.8)"
fi

# Copies the files of $1 that differ into $2 (with a new mtime, so that
# ninja rebuilds what depends on them) and removes from $2 the files $1 no
# longer has, leaving $2's build outputs alone.
sync_tree() {
  local from=$1 to=$2 f
  mkdir -p "$to"
  (cd "$from" && find . -type f -print0) |
    while IFS= read -r -d '' f; do
      if ! cmp -s "$from/$f" "$to/$f"; then
        mkdir -p "$(dirname "$to/$f")"
        cp "$from/$f" "$to/$f"
      fi
    done
  (cd "$to" && find . -type f -not -path './build/*' \
    -not -path '*.egg-info/*' -print0) |
    while IFS= read -r -d '' f; do
      [[ -e "$from/$f" ]] || rm -f "$to/$f"
    done
}

HASH=$(cd "$STAGE" && find . -type f -print0 | sort -z | xargs -0 sha256sum |
  sha256sum | cut -c1-16)
BUILT="$VENV/.vcl-built-from"
installed() {
  (cd "$BUILD_ROOT" && "$PY" -c 'import vllm_cpu_lora') 2>/dev/null
}
if [[ -f "$BUILT" && "$(cat "$BUILT")" == "$HASH" && -d "$SRC" ]] && installed
then
  log "vllm_cpu_lora is up to date in the side environment ($HASH)"
  rm -rf "$STAGE"
else
  sync_tree "$STAGE" "$SRC"
  rm -rf "$STAGE"
  log "building vllm_cpu_lora against torch $TORCH_BUILD in $SRC" \
    "(--no-deps: our pyproject pins torch==2.13.0)"
  start=$(date +%s)
  if ! heavy "$PY" -m pip install --no-build-isolation --no-deps "$SRC" \
    >"$BUILD_ROOT/build.log" 2>&1; then
    first_error=$(grep -m1 -E 'error:|Error' "$BUILD_ROOT/build.log" || true)
    fail "vllm_cpu_lora does not build against torch $TORCH_BUILD:" \
      "${first_error:-see the log} (full log: $BUILD_ROOT/build.log)"
  fi
  echo "$HASH" >"$BUILT"
  log "built in $(($(date +%s) - start)) s"
fi

COMMIT=$(git rev-parse --short HEAD)
DIRTY=""
[[ -z "$(git status --porcelain --untracked-files=no)" ]] ||
  DIRTY=" plus uncommitted changes"
export VLLM_CPU_LORA_BUILD_NOTE="the working tree at $COMMIT$DIRTY$PATCHED"

# --- 3. The comparison --------------------------------------------------------
# -P: the checkout's own vllm_cpu_lora (built for the main .venv's torch)
# must not shadow the one installed in the side environment; the
# checkout's benchmarks/ comes through a folder that holds only it.
BENCH_PATH="$BUILD_ROOT/benchmarks-only"
rm -rf "$BENCH_PATH"
mkdir -p "$BENCH_PATH"
ln -s "$REPO/benchmarks" "$BENCH_PATH/benchmarks"
log "running python -P -m benchmarks.ipex $*"
rc=0
PYTHONPATH="$BENCH_PATH" heavy "$PY" -P -m benchmarks.ipex "$@" || rc=$?
case "$rc" in
  0) log "done: $OUT_DIR/ipex.md" ;;
  2) log "IPEX is not usable here; the reason is in $OUT_DIR/ipex.md" ;;
  *) log "the comparison exited with $rc (see above and $OUT_DIR/ipex.md)" ;;
esac
exit "$rc"
