"""ISA path selection on each architecture, the paths a build chooses, and
the plug-in off x86.

The paths are detected per architecture (csrc/cpu/isa.cpp); on aarch64 these
run under qemu (scripts/test_arm.sh), with and without BF16.
"""

import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest
import torch

import build_isas
import vllm_cpu_lora
from vllm_cpu_lora import plugin

ISA_ENV = "VLLM_CPU_LORA_ISA"
REPO = pathlib.Path(__file__).resolve().parents[1]

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


def test_every_path_is_built_unless_the_build_chose_fewer():
    if os.environ.get(build_isas.ENV, "all") != "all":
        pytest.skip(f"built with {build_isas.ENV} set")
    assert vllm_cpu_lora.built_isas() == KNOWN


@pytest.mark.skipif(
    platform.machine() != "x86_64", reason="native selects every path there"
)
def test_native_build_selects_the_paths_this_cpu_runs():
    """build_isas.py's CPU tests (torch's) agree with csrc/cpu/isa.cpp's."""
    native = build_isas.selected_paths("native") & set(KNOWN)
    runs = set(vllm_cpu_lora.supported_isas()) - {"amx_emulated"}
    assert {*native, "scalar"} == runs


def test_build_path_list_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown path.*avx9"):
        build_isas.selected_paths("avx2,avx9")


@pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the subset is x86's avx2"
)
@pytest.mark.skipif(
    os.environ.get("VLLM_CPU_LORA_SANITIZED") == "1",
    reason="the subset links the in-tree objects, not the sanitized ones",
)
def test_a_build_of_some_paths_has_only_those(tmp_path):
    """VLLM_CPU_LORA_BUILD_ISAS=avx2 links only the avx2 and scalar kernels
    (reusing the in-tree build's objects): the others are neither listed nor
    forceable, and a call runs and is right."""
    # The venv's ninja, which made the in-tree objects: another version
    # would compile them all again (docs/vllm.md).
    path = f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, build_isas.ENV: "avx2", "PATH": path}
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
         str(tmp_path)],
        cwd=REPO, env=env, check=True, capture_output=True,
    )  # fmt: skip
    for source in (REPO / "vllm_cpu_lora").glob("*.py"):
        shutil.copy(source, tmp_path / "vllm_cpu_lora")
    check = """
import os, torch, vllm_cpu_lora
from vllm_cpu_lora import ops
assert vllm_cpu_lora.__file__.startswith(os.getcwd()), vllm_cpu_lora.__file__
print(vllm_cpu_lora.built_isas(), vllm_cpu_lora.supported_isas())
x = torch.randn(5, 77, dtype=torch.bfloat16)
w = torch.randn(3, 9, 77, dtype=torch.bfloat16)
idx = torch.tensor([2, -1, 0, 2, 1])
out = torch.full((5, 9), float("nan"))
ops.bgmv_shrink(x, w, out, idx, 0.5)
# Exact products, fp32 sums of 77 terms, one rounding: within 78 units of
# fp32 rounding of the sum of the terms' magnitudes; -1 rows are zeros.
sel = w[idx.clamp(min=0)].double()
exact = torch.einsum("tk,tnk->tn", x.double(), sel) * 0.5
size = torch.einsum("tk,tnk->tn", x.double().abs(), sel.abs()) * 0.5
assert (out[idx < 0] == 0).all(), out
assert ((out.double() - exact).abs() <= 78 * 2**-24 * size)[idx >= 0].all()
os.environ["VLLM_CPU_LORA_ISA"] = "avx512"
try:
    vllm_cpu_lora.isa()
except RuntimeError as error:
    print(error)
"""
    env.pop(ISA_ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, check=True,
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    built, error = out.splitlines()
    expected = ["avx2", "scalar"]
    if "avx2" not in vllm_cpu_lora.supported_isas():
        expected = ["scalar"]
    assert built == f"{['avx2', 'scalar']} {expected}"
    assert error == (
        f"{ISA_ENV}=avx512 is not built into this install (built: avx2, "
        f"scalar); {build_isas.ENV} chose the paths at build time"
    )


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
