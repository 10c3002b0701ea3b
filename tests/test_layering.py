"""The package's import graph (read from the source, nothing imported): stages import one way only,
no module imports another that imports it back, and no import hides inside a function to dodge a
cycle (the command line alone loads its commands lazily, for a fast ``--help``)."""

from __future__ import annotations

import ast
from pathlib import Path

import coda_cutlass

ROOT = Path(coda_cutlass.__file__).resolve().parent
LAZY_OK = {"coda_cutlass.cli"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


MODULES = _modules()


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("coda_cutlass"):
        return []
    out = []
    for alias in node.names:          # `from . import api` names a module, `from .x import y` an attribute
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(mod: str) -> list[tuple[str, bool]]:
    """(imported coda_cutlass module, inside a function) for every import that runs."""
    path = MODULES[mod]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                found.extend((m, in_function) for m in _resolve(mod, path.name == "__init__.py", child))
            elif isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names if a.name.startswith("coda_cutlass"))
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return [(m, f) for m, f in found if m in MODULES and m != mod]


# Edges to the root package (``from .. import __version__``) are left out: every submodule import
# loads the root first anyway, and the root only re-exports the public API.
GRAPH = {m: sorted({t for t, _ in imports(m) if t != "coda_cutlass"}) for m in MODULES}


def reachable(start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(GRAPH[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(GRAPH[m])
    return seen


def test_no_import_cycles():
    cycles = [m for m in MODULES if m in reachable(m)]
    assert not cycles, f"modules that import themselves back: {cycles}"


def test_no_imports_hidden_in_functions():
    hidden = [(m, t) for m in MODULES if m not in LAZY_OK for t, in_fn in imports(m) if in_fn]
    assert not hidden, f"function-local imports of package modules: {hidden}"


def _under(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


def _forbidden(prefixes: list[str], banned: list[str]) -> list[tuple[str, str]]:
    bad = []
    for p in prefixes:
        for m in _under(p):
            bad += [(m, r) for r in reachable(m) if any(r == b or r.startswith(b + ".") for b in banned)]
    return bad


def test_stages_import_one_way():
    pkg = "coda_cutlass."
    front = [pkg + s for s in ("ir", "frontend", "passes", "lower", "render", "pipeline", "partials", "interpret")]
    back = [pkg + s for s in ("build", "runtime", "compiler", "tuning", "api", "cli", "demo")]
    assert not _forbidden(front, back), "the front half (program -> source) must not import the back half"
    assert not _forbidden([pkg + "build"], [pkg + s for s in ("api", "pipeline", "compiler", "tuning", "runtime")])
    assert not _forbidden([pkg + "runtime"], [pkg + s for s in ("interpret", "compiler", "tuning", "api")])
    assert not _forbidden([pkg + "tuning"], [pkg + "api"])
