"""What differs between the vLLM releases this package supports.

The wrapper needs no per-release code: `PunicaWrapperCPU` and
`PunicaWrapperBase` are the same in vLLM 0.32 and 0.33. What differs is
recorded here, for the plug-in's version check and for the tests.
"""

from packaging.version import InvalidVersion, Version

__all__ = ["TESTED_VLLM", "is_tested", "torch_ops_misapply_no_lora"]

# (major, minor) of the vLLM releases the vLLM test suite runs on.
TESTED_VLLM = ((0, 32), (0, 33))


def _release(version: str) -> tuple[int, ...]:
    try:
        return Version(version).release[:2]
    except InvalidVersion:
        return ()


def is_tested(version: str) -> bool:
    """Whether vLLM `version` is one of TESTED_VLLM."""
    return _release(version) in TESTED_VLLM


def torch_ops_misapply_no_lora(version: str) -> bool:
    """Whether vLLM `version`'s own CPU LoRA ops add an adapter to rows
    without one: before 0.33 their expand gathers `weights[-1]` for index
    -1, the last slot's adapter, where 0.33 leaves those rows alone."""
    return () < _release(version) < (0, 33)
