"""The layering rules, checked statically: every module's imports (parsed with ast, lazy ones
inside functions included) go only to its own layer or lower ones, and no import circle exists
between forge's modules. Layers, bottom up (docs/design.md):

  0 forge.spec, forge.errors, forge._runtime   the math, the checks, where kernels run
  1 forge_pallas                              pure JAX kernels
  2 forge_triton, bridge                      the backends (torch side)
  3 forge.ops                                 registry, torch.library ops, backend-neutral nodes
  4 forge.patching, forge (package), forge.__main__
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("forge", "forge_triton", "forge_pallas", "bridge")


def _layer(mod: str) -> int | None:
    if mod.startswith(("forge.spec", "forge.errors", "forge._runtime")):
        return 0
    if mod.startswith("forge_pallas"):
        return 1
    if mod.startswith(("forge_triton", "bridge")):
        return 2
    if mod == "forge.ops" or mod.startswith("forge.ops."):
        return 3
    if mod == "forge" or mod.startswith("forge."):
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


def _nodes(tree, lazy: bool):
    """Every node, or (``lazy=False``) those that run at import: not inside a function."""
    if lazy:
        yield from ast.walk(tree)
        return
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node)
                    if not isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))


def _imports(name: str, path: pathlib.Path, known, lazy: bool = True) -> set[str]:
    """forge's modules that ``name`` imports (absolute and relative; ``lazy``: inside functions
    too)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in _nodes(ast.parse(path.read_text()), lazy):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(base[:len(base) - node.level + 1])
                mod = f"{stem}.{node.module}" if node.module else stem
            else:
                mod = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            # the longest known module the target names
            parts = t.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts:
                found.add(".".join(parts))
    found.discard(name)
    return found


def _graph(lazy: bool = True):
    mods = _modules()
    return {name: _imports(name, path, mods, lazy) for name, path in mods.items()}


def _top(mod: str) -> str:
    return mod.split(".")[0] if not mod.startswith("forge.") else ".".join(mod.split(".")[:2])


def test_no_lower_layer_imports_a_higher_one():
    bad = []
    for mod, deps in _graph().items():
        lm = _layer(mod)
        for d in deps:
            ld = _layer(d)
            if lm is not None and ld is not None and ld > lm:
                bad.append(f"{mod} (layer {lm}) imports {d} (layer {ld})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circle():
    # edges: what a module imports when it loads, and any import (lazy ones too) that leaves its
    # package (forge.spec, forge.ops, forge_triton, ...): no circle may cross packages, and none
    # may run at import time. (A function-level import between two modules of one package, e.g.
    # forge.patching.copying calling back into forge.patching.core, is no circle at load time.)
    eager, lazy = _graph(lazy=False), _graph(lazy=True)
    graph = {m: eager[m] | {d for d in lazy[m] if _top(d) != _top(m)} for m in eager}

    # a package's __init__ importing its own submodules is how Python packages load
    def edges(m):
        return {d for d in graph[m] if not d.startswith(m + ".")}

    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in edges(m):
            if state.get(d) == 1:
                circles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_checker_sees_an_upward_import(tmp_path):
    # the parser must catch what the rules forbid: a lazy import inside a function, relative
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..ops import library\n")
    assert _imports("forge.spec.m", src, {"forge.ops", "forge.ops.library", "forge.spec"}) == {"forge.ops.library"}
