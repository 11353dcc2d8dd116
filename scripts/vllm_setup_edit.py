"""Edits vLLM's setup.py so that a CPU build on x86 makes one extension.

vLLM's setup.py builds three x86 CPU extensions (`vllm._C` for AVX512-BF16
and AMX, `vllm._C_AVX512`, `vllm._C_AVX2`) and loads one at run time;
building only the one a CPU loads saves a third to a half of the build. The
edit works on the parsed file: each unwanted
``ext_modules.append(CMakeExtension(name=...))`` statement of the x86 CPU
branch becomes ``pass`` on its own lines, so no block is ever left empty,
and the result is parsed again and must list exactly the wanted extension.
"""

from __future__ import annotations

import ast

X86_EXTENSIONS = ("vllm._C", "vllm._C_AVX512", "vllm._C_AVX2")


class SetupEditError(RuntimeError):
    """setup.py is not shaped as this edit expects, or the edit failed."""


def cpu_extensions(text: str) -> tuple[list[str], list[str]]:
    """The CPU extensions setup.py builds: (on x86, elsewhere)."""
    branch = _x86_cpu_branch(_parse(text))
    return _names(branch.body), _names(branch.orelse)


def build_only(text: str, extension: str) -> str:
    """setup.py's text with the x86 CPU branch building only `extension`.

    Raises:
        SetupEditError: `extension` is not one of the branch's, the file
            has no such branch, or the edited file does not check out.
    """
    branch = _x86_cpu_branch(_parse(text))
    if extension not in _names(branch.body):
        raise SetupEditError(
            f"setup.py's x86 CPU branch lists {_names(branch.body)}, "
            f"not {extension}"
        )
    lines = text.splitlines(keepends=True)
    for stmt in reversed(branch.body):
        name = _extension_name(stmt)
        if name is None or name == extension:
            continue
        first, last = stmt.lineno - 1, stmt.end_lineno
        indent = lines[first][: stmt.col_offset]
        if indent.strip() or lines[last - 1][stmt.end_col_offset :].strip():
            raise SetupEditError(
                f"setup.py line {stmt.lineno}: {name} shares a line with "
                "other code"
            )
        lines[first:last] = [f"{indent}pass  # not built: {name}\n"]
    edited = "".join(lines)
    on_x86, _ = cpu_extensions(edited)
    if on_x86 != [extension]:
        raise SetupEditError(
            f"the edited setup.py lists {on_x86} on x86, not [{extension}]"
        )
    return edited


def _parse(text: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError as e:
        raise SetupEditError(f"setup.py does not parse: {e}") from None


def _x86_cpu_branch(tree: ast.Module) -> ast.If:
    """``if platform.machine() in (...x86...):`` inside ``if _is_cpu():``."""
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "_is_cpu()":
            for inner in node.body:
                if isinstance(inner, ast.If) and "x86_64" in ast.unparse(
                    inner.test
                ):
                    return inner
    raise SetupEditError(
        "setup.py has no `if _is_cpu():` block with an x86_64 branch"
    )


def _names(body: list[ast.stmt]) -> list[str]:
    return [n for n in map(_extension_name, body) if n is not None]


def _extension_name(stmt: ast.stmt) -> str | None:
    """NAME of ``ext_modules.append(CMakeExtension(name=NAME))``, else None."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    call = stmt.value
    if ast.unparse(call.func) != "ext_modules.append" or len(call.args) != 1:
        return None
    ext = call.args[0]
    if not (
        isinstance(ext, ast.Call) and ast.unparse(ext.func) == "CMakeExtension"
    ):
        return None
    for keyword in ext.keywords:
        if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
            return keyword.value.value
    return None
