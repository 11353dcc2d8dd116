"""``python -m vllm_cpu_lora.bench``: the benchmark parts, one command."""

import sys

from vllm_cpu_lora.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
