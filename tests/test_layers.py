"""The layering rules, checked statically: every module's imports (parsed with ast, those inside
functions included) go only to its own layer or lower ones, and the import graph of forge's
packages has no circle. Layers, bottom up (docs/design.md):

  0 forge.spec, forge.errors, forge._runtime, forge.defaults   the math, the checks, the settings
  1 forge_pallas                                               pure JAX kernels
  2 forge_triton, bridge                                       the backends (torch side)
  3 forge.ops                                                  registry, torch.library ops, nodes
  4 forge.patching, forge (package), forge.__main__

and, within them: forge.spec imports torch and the standard library only (besides forge.errors,
its exception classes); forge_pallas never imports torch; forge_triton never imports jax;
forge.ops never imports forge.patching; forge.patching (the graph runtime included) reaches a
backend only through forge.ops, never importing forge_triton, forge_pallas or bridge.
"""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("forge", "forge_triton", "forge_pallas", "bridge")
BASE = ("forge.spec", "forge.errors", "forge._runtime", "forge.defaults")
BACKENDS = ("forge_triton", "forge_pallas", "bridge")


def _under(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _layer(mod: str) -> int | None:
    if _under(mod, *BASE):
        return 0
    if _under(mod, "forge_pallas"):
        return 1
    if _under(mod, "forge_triton", "bridge"):
        return 2
    if _under(mod, "forge.ops"):
        return 3
    if _under(mod, "forge"):
        return 4
    return None  # not forge's


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _targets(name: str, path: pathlib.Path, known) -> set[str]:
    """Every module ``name`` imports, at module level or inside a function, relative imports
    resolved: ``from pkg import x`` names ``pkg.x`` where that is one of ``known``, else ``pkg``."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(base[:len(base) - node.level + 1])
                mod = f"{stem}.{node.module}" if node.module else stem
            else:
                mod = node.module or ""
            found.update(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names)
    return found


def _imports(name: str, path: pathlib.Path, known) -> set[str]:
    """forge's modules that ``name`` imports: for each target the longest known module it names."""
    found = set()
    for t in _targets(name, path, known):
        parts = t.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts:
            found.add(".".join(parts))
    found.discard(name)
    return found


def _graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _circles(graph) -> list[list[str]]:
    """One circle through each strongly connected group of ``graph`` (Tarjan's algorithm)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    out = []
    for group in groups:  # walk from one member inside the group until a module repeats
        path = [min(group)]
        while path.count(path[-1]) < 2:
            path.append(min(w for w in graph[path[-1]] if w in group))
        out.append(path[path.index(path[-1]):])
    return out


def test_no_import_circle():
    # every import counts: module-level and inside functions (a lazy import still makes the two
    # modules need each other), a package's __init__ importing its own modules too
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_no_lower_layer_imports_a_higher_one():
    bad = []
    for mod, deps in _graph().items():
        lm = _layer(mod)
        for d in deps:
            ld = _layer(d)
            if lm is not None and ld is not None and ld > lm:
                bad.append(f"{mod} (layer {lm}) imports {d} (layer {ld})")
    assert not bad, "\n".join(sorted(bad))


def _external(owner: str) -> dict[str, set[str]]:
    """Per module of ``owner`` (a package or module prefix), the top-level names it imports."""
    mods = _modules()
    return {name: {t.split(".")[0] for t in _targets(name, path, mods)}
            for name, path in mods.items() if _under(name, owner)}


STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


@pytest.mark.parametrize("owner, allowed", [
    ("forge.spec", {"torch", "forge"}),  # forge: forge.spec itself and forge.errors (checked below)
    ("forge.errors", set()),
    ("forge.defaults", set()),
])
def test_the_base_imports_torch_and_the_standard_library_only(owner, allowed):
    bad = {m: sorted(t - STDLIB - allowed) for m, t in _external(owner).items() if t - STDLIB - allowed}
    assert not bad, bad
    mods = _modules()
    for name, path in mods.items():
        if _under(name, owner):
            forge_deps = {d for d in _imports(name, path, mods) if not _under(d, owner)}
            assert forge_deps <= {"forge.errors"}, (name, forge_deps)


@pytest.mark.parametrize("owner, banned", [
    ("forge_pallas", "torch"),
    ("forge_triton", "jax"),
    ("forge_triton", "jaxlib"),
])
def test_a_backend_keeps_to_its_framework(owner, banned):
    bad = sorted(m for m, t in _external(owner).items() if banned in t)
    assert not bad, f"{owner} modules importing {banned}: {bad}"


@pytest.mark.parametrize("owner, banned", [
    ("forge.ops", ("forge.patching",)),
    # the graph runtime and the rest of the patching layer reach kernels through forge.ops only
    ("forge.patching", BACKENDS),
    ("forge.patching.graphs", BACKENDS),
    ("forge.patching.decode", BACKENDS),
    ("forge.patching.decode_runtime", BACKENDS),
])
def test_forbidden_imports(owner, banned):
    mods = _modules()
    found = {name: _targets(name, path, mods) for name, path in mods.items() if _under(name, owner)}
    assert found, f"no module {owner}"
    bad = {m: sorted(t for t in ts if _under(t, *banned)) for m, ts in found.items()
           if any(_under(t, *banned) for t in ts)}
    assert not bad, bad


def test_the_checker_sees_lazy_relative_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..ops import library\n")
    assert _imports("forge.spec.m", src, {"forge.ops", "forge.ops.library", "forge.spec"}) == {"forge.ops.library"}


def test_the_checker_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_bridge_keeps_its_files_short():
    # one concern per file (bridge/native/ is split by concern): none grows past 500 lines
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "bridge").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
