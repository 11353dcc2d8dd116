"""Kept for old command lines: the kernel benchmark is vllm_cpu_lora.bench."""

import sys

from vllm_cpu_lora.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
