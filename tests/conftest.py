"""Shared fixtures of the kernel tests."""

import pytest

import vllm_cpu_lora

ISA_ENV = "VLLM_CPU_LORA_ISA"


@pytest.fixture(params=vllm_cpu_lora.supported_isas())
def isa(request, monkeypatch):
    """Forces each ISA path this CPU can run, one per test instance.

    The C++ ops read VLLM_CPU_LORA_ISA on every call, so setting it for the
    duration of the test is enough; monkeypatch restores it afterwards.
    """
    monkeypatch.setenv(ISA_ENV, request.param)
    assert vllm_cpu_lora.isa() == request.param
    return request.param


def pytest_report_header():
    return (
        f"vllm_cpu_lora: paths built {vllm_cpu_lora.built_isas()}, run by "
        f"this CPU {vllm_cpu_lora.supported_isas()}"
    )


def pytest_collection_modifyitems(items):
    """Runs the ISA instances of each test_ops.py case back to back.

    With the ISA varying fastest, test_ops.py reuses one oracle result for
    all ISA paths of a case instead of recomputing it per path. The sort is
    stable and leaves other files' tests where they are.
    """

    def case_key(item):
        callspec = getattr(item, "callspec", None)
        if item.path.name != "test_ops.py" or callspec is None:
            return item.nodeid
        params = dict(callspec.params)
        params.pop("isa", None)
        return item.nodeid.split("[")[0], repr(sorted(params.items()))

    first = {}
    for position, item in enumerate(items):
        first.setdefault(case_key(item), position)
    items.sort(key=lambda item: first[case_key(item)])
