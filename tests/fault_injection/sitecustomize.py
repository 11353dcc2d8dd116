"""Test support: a kernel fault inside vLLM's engine, on demand.

tests/test_vllm_crash.py puts this folder on the PYTHONPATH of a `vllm
serve`, so Python imports this module at start-up in each of its processes.
In every process that then imports `vllm_cpu_lora.ops`, `lora_shrink` reads
address 0 (SIGSEGV, from C, as a kernel's bad memory access would) the first
time a row of its batch has an adapter. Base-model batches run normally.
"""

import ctypes
import importlib.abc
import importlib.util
import sys

_TARGET = "vllm_cpu_lora.ops"


def _fault_on_adapter_rows(ops) -> None:
    shrink = ops.lora_shrink

    def lora_shrink(inputs, lora_a_weights, output_tensor, indices, *args):
        if bool((indices >= 0).any()):
            ctypes.string_at(0)
        return shrink(inputs, lora_a_weights, output_tensor, indices, *args)

    ops.lora_shrink = lora_shrink


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds `_TARGET` as the other finders do, patched once executed."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _fault_on_adapter_rows(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
