#!/usr/bin/env bash
# For a lent GPU machine (no network; its own python3 with a CUDA torch):
# builds the extension in place against that torch, runs the CUDA dispatch
# tests and the kernel tests on its CPU (every ISA path it can run), then the
# kernel benchmark on all its cores. Results go to $OUT (default
# benchmarks/results/device). Each stage has a time limit so the whole run
# fits one device call.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/device}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  echo "== machine"
  date -u
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|L2|L3" || true
  grep -m1 -o -w -E "amx_bf16|avx512_bf16|avx512f|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '
  echo
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/machine.txt"
echo "== build"
MAX_JOBS=16 timeout 300 python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; exit 1; }
python3 -c "import vllm_cpu_lora as v; print('paths', v.supported_isas(), 'auto', v.isa())" | tee -a "$out/machine.txt"
echo "== tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_ops.py tests/test_bad_inputs.py 2>&1 | tail -15 | tee "$out/tests.txt"
echo "== kernel benchmark, all cores"
timeout "${BENCH_LIMIT_S:-220}" python3 -m benchmarks.kernels \
  --threads all --out "$out" >"$out/bench.log" 2>&1
echo "benchmark rc=$?"
sed -n '/^## Summary/,$p' "$out/ops.md" 2>/dev/null | head -40
