"""ISA path selection on each architecture, and the plug-in off x86.

The paths are detected per architecture (csrc/cpu/isa.cpp); on aarch64 these
run under qemu (scripts/test_arm.sh), with and without BF16.
"""

import logging
import platform

import pytest
import torch

import vllm_cpu_lora
from vllm_cpu_lora import plugin

ISA_ENV = "VLLM_CPU_LORA_ISA"

# Each architecture's paths, best first, test-only ones last.
KNOWN = {
    "x86_64": [
        "amx",
        "avx512_bf16",
        "avx512",
        "avx2",
        "scalar",
        "amx_emulated",
    ],
    "aarch64": ["neon_bf16", "neon", "scalar"],
}[platform.machine()]


def test_supported_paths_are_known_and_scalar_is_always_there():
    supported = vllm_cpu_lora.supported_isas()
    assert supported == [name for name in KNOWN if name in supported]
    assert "scalar" in supported


def test_unknown_path_error_lists_this_architectures_paths(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "no_such_isa")
    known = ", ".join(KNOWN)
    with pytest.raises(RuntimeError, match=f"known: {known};"):
        vllm_cpu_lora.isa()


@pytest.mark.parametrize("name", KNOWN)
def test_forcing_a_path_this_cpu_lacks_fails(name, monkeypatch):
    supported = vllm_cpu_lora.supported_isas()
    monkeypatch.setenv(ISA_ENV, name)
    if name in supported:
        assert vllm_cpu_lora.isa() == name
        return
    message = f"{ISA_ENV}={name} is not supported by this CPU"
    with pytest.raises(RuntimeError, match=message):
        vllm_cpu_lora.isa()


def test_amx_tile_request_is_a_no_op_without_amx(monkeypatch, caplog):
    """On CPUs without AMX tiles, every Arm CPU among them, the plug-in's
    tile request neither asks Linux for tile state nor warns."""
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX tiles")

    def init_amx():
        raise AssertionError("asked Linux for AMX tile state")

    monkeypatch.setattr(torch.cpu, "_init_amx", init_amx)
    monkeypatch.setattr(plugin.logger, "propagate", False)
    plugin.logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG, logger=plugin.logger.name):
            plugin._request_amx_tiles()
    finally:
        plugin.logger.removeHandler(caplog.handler)
    assert caplog.records == []
