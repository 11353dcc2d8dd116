"""`vllm_cpu_lora.ops` on CUDA tensors: the pure-torch reference runs on the
GPU (the path for GPUs below compute capability 8.0, where vLLM's Triton
kernels do not run). Skipped without a CUDA device."""

import pytest
import torch
from test_ops import (
    ALL_DTYPE_COMBOS,
    ALL_OPS,
    base_call,
    check,
    dtypes_id,
    make_generator,
    moderate_calls,
)

import vllm_cpu_lora.ops as ops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"
)


def run_on_cuda(call) -> torch.Tensor:
    """Runs `call` through vllm_cpu_lora.ops with every tensor on the GPU
    and returns the output, back on the CPU."""
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in call.args]
    getattr(ops, call.op)(*args)
    torch.cuda.synchronize()
    assert args[call.out].is_cuda
    return args[call.out].cpu()


@pytest.mark.parametrize("dtypes", ALL_DTYPE_COMBOS, ids=dtypes_id)
@pytest.mark.parametrize("op", ALL_OPS)
def test_cuda_tensors_take_the_reference(op, dtypes):
    """Every op and dtype combination on the GPU, checked against the
    float64 oracle with the kernels' error bound (the reference also
    accumulates in fp32); poisoned output elements must stay NaN."""
    gen = make_generator("cuda", op, dtypes)
    calls = [base_call(op, dtypes, gen), *moderate_calls(op, dtypes, gen)]
    for call in calls:
        check(call, None, run=run_on_cuda)
