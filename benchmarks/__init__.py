"""Benchmarks of vllm_cpu_lora: ``python -m benchmarks`` from the checkout.

Not part of the installed package (the wheel holds only the runtime).

Parts: ``kernels`` (the ops against vLLM's torch algorithm, grouped torch and
the measured hardware bound), ``layer`` (LoRA's share of a Llama-7B layer),
``vllm_e2e`` (CPU vLLM tokens/s with and without adapters) and ``ipex``
(Intel Extension for PyTorch's punica ops, in a side environment).
"""
