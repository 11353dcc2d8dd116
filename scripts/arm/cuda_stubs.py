"""Stand-in libraries for the CUDA libraries PyPI's aarch64 torch links to.

PyPI's aarch64 torch wheel is a CUDA build: libtorch_cpu.so itself needs
libcudart and libcupti, and the wheel's CUDA dependencies are several GB.
The emulated tests (scripts/test_arm.sh) never touch CUDA, so each missing
library is replaced by a stub with the same soname, the same symbol versions
and every symbol torch takes from it; each function returns 100
(cudaErrorNoDevice), so torch sees no GPU. Nothing else is replaced: the
CPU code under test is the wheel's own.

Usage: cuda_stubs.py TORCH_LIB_DIR SYSROOT OUT_DIR CC
"""

import glob
import os
import re
import shlex
import subprocess
import sys

READELF = os.environ.get("READELF", "readelf")
LIB_DIRS = ("lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu")


def readelf(flags: str, path: str) -> str:
    return subprocess.run(
        [READELF, "-W", flags, path], check=True, capture_output=True, text=True
    ).stdout


def is_elf(path: str) -> bool:
    if os.path.islink(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def needed(path: str) -> list[str]:
    return re.findall(r"\(NEEDED\).*\[(.+)\]", readelf("-d", path))


def version_files(path: str) -> dict[str, str]:
    """Version name -> the soname it is needed from (.gnu.version_r)."""
    files, current = {}, None
    for line in readelf("-V", path).splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif current and (m := re.search(r"Name: (\S+)", line)):
            files[m.group(1)] = current
    return files


def symbols(path: str):
    """(name, version or None, type, defined) of each global dynamic symbol."""
    for line in readelf("--dyn-syms", path).splitlines():
        f = line.split()
        if len(f) < 8 or f[4] not in ("GLOBAL", "WEAK"):
            continue
        name, _, version = f[7].partition("@")
        version = version.lstrip("@").split(" ")[0] or None
        if f[6] != "UND":
            yield name, version, f[3], True
        elif f[4] == "GLOBAL":  # Weak references may stay unresolved.
            yield name, version, f[3], False


def main(torch_lib: str, sysroot: str, out: str, cc: str) -> None:
    torch_libs = glob.glob(os.path.join(torch_lib, "*.so*"))
    torch_libs += glob.glob(os.path.join(torch_lib, "..", "_C*.so"))
    present = {os.path.basename(p) for p in torch_libs}
    for d in LIB_DIRS:
        present |= set(os.listdir(os.path.join(sysroot, d)))
    defined = set()
    stubs: dict[str, dict[str, tuple[str | None, str]]] = {}
    pending = []  # Unversioned references: resolved once all are read.
    for lib in torch_libs:
        missing = [n for n in needed(lib) if n not in present]
        files = version_files(lib)
        for name, version, kind, is_defined in symbols(lib):
            if is_defined:
                defined.add(name)
            elif version and files.get(version) in missing:
                stubs.setdefault(files[version], {})[name] = (version, kind)
            elif not version and missing:
                pending.append((missing[0], name, kind))
        for soname in missing:
            stubs.setdefault(soname, {})
    for d in LIB_DIRS:
        for p in glob.glob(os.path.join(sysroot, d, "lib*.so*")):
            if is_elf(p):
                defined |= {s[0] for s in symbols(p) if s[3]}
    for soname, name, kind in pending:
        if name not in defined:
            stubs[soname].setdefault(name, (None, kind))
    os.makedirs(out, exist_ok=True)
    for soname, syms in sorted(stubs.items()):
        write_stub(out, soname, syms, cc)
    print(f"cuda_stubs: {len(stubs)} stub libraries in {out}")


def write_stub(out: str, soname: str, syms, cc: str) -> None:
    src = os.path.join(out, soname + ".c")
    script = os.path.join(out, soname + ".map")
    lines = ["long no_cuda(void) { return 100; /* cudaErrorNoDevice */ }"]
    nodes: dict[str, list[str]] = {soname: []} if not syms else {}
    for i, (name, (version, kind)) in enumerate(sorted(syms.items())):
        if kind == "OBJECT":
            lines.append(f'char s{i}[256] __asm__("{name}");')
        else:
            lines.append(
                f'extern long s{i}(void) __asm__("{name}") '
                '__attribute__((alias("no_cuda")));'
            )
        nodes.setdefault(version or soname, []).append(name)
    with open(src, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(script, "w") as f:
        for i, (version, names) in enumerate(nodes.items()):
            body = (
                " global:" + "".join(f' "{n}";' for n in names) if names else ""
            )
            local = " local: *;" if i == len(nodes) - 1 else ""
            f.write(f"{version} {{{body}{local} }};\n")
    subprocess.run(
        [
            *shlex.split(cc),
            "-shared",
            "-fPIC",
            "-o",
            os.path.join(out, soname),
            src,
            f"-Wl,-soname,{soname}",
            f"-Wl,--version-script={script}",
        ],
        check=True,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
