"""The source route's edit of vLLM's setup.py, on the real setup.py.

scripts/install_vllm_cpu.py builds only the vLLM extension a CPU loads by
editing the x86 branch of setup.py (scripts/vllm_setup_edit.py, applied by
scripts/vllm_install/source_route.py). For each choice (AMX/AVX512-BF16
`_C`, `_C_AVX512`, `_C_AVX2`) the edited file must parse, list exactly that
extension on x86, and leave the other branches (aarch64 and the rest, which
build `_C`) as they were. The sdist comes from the installer's cache,
downloaded (47 MB, sha256-checked) when missing.
"""

import ast
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import vllm_setup_edit  # noqa: E402
from vllm_install import common, source_route  # noqa: E402


@pytest.fixture(scope="module", params=sorted(source_route.SDISTS))
def setup_py(request) -> str:
    sdist = common.download(source_route.SDISTS[request.param])
    with tarfile.open(sdist) as tar:
        member = f"vllm-{request.param}/setup.py"
        return tar.extractfile(member).read().decode()


def test_the_sdist_builds_three_x86_extensions(setup_py):
    on_x86, elsewhere = vllm_setup_edit.cpu_extensions(setup_py)
    assert on_x86 == list(vllm_setup_edit.X86_EXTENSIONS)
    assert elsewhere == ["vllm._C"]


@pytest.mark.parametrize("extension", vllm_setup_edit.X86_EXTENSIONS)
def test_build_only_keeps_setup_py_valid(setup_py, extension):
    edited = vllm_setup_edit.build_only(setup_py, extension)
    ast.parse(edited)
    assert vllm_setup_edit.cpu_extensions(edited) == ([extension], ["vllm._C"])
    # Only the two dropped statements changed, one line each.
    before, after = setup_py.splitlines(), edited.splitlines()
    assert len(before) == len(after)
    changed = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert len(changed) == 2
    for old, new in changed:
        assert f'"{extension}"' not in old
        assert new.strip().startswith("pass  # not built: vllm._C")
    # Editing again (a rerun) changes nothing more.
    assert vllm_setup_edit.build_only(edited, extension) == edited


def test_build_only_refuses_an_unknown_extension(setup_py):
    with pytest.raises(vllm_setup_edit.SetupEditError, match="vllm._C_SSE"):
        vllm_setup_edit.build_only(setup_py, "vllm._C_SSE")


def test_build_only_refuses_a_setup_py_of_another_shape():
    with pytest.raises(vllm_setup_edit.SetupEditError, match="no `if _is_cpu"):
        vllm_setup_edit.build_only("ext_modules = []\n", "vllm._C")
    with pytest.raises(vllm_setup_edit.SetupEditError, match="does not parse"):
        vllm_setup_edit.build_only("if _is_cpu(:\n", "vllm._C")


def test_a_download_with_another_hash_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "CACHE", tmp_path / "cache")
    served = tmp_path / "vllm-0.0.0.tar.gz"
    served.write_bytes(b"not the pinned file")
    pinned = common.Artifact(served.as_uri(), "0" * 64)
    with pytest.raises(common.InstallError, match="expected 0000"):
        common.download(pinned)
    assert not list((tmp_path / "cache").rglob("vllm-*"))
