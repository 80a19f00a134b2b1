"""The benchmarks a user runs (``bench/*.py``) use forge's public API only: no name starting
with ``_`` of forge, forge_triton, forge_pallas or bridge, whether imported, reached as an
attribute of an imported module, looked up with ``getattr`` or ``importlib``, or used in a child
script kept as a string. One-off diagnostics, which may reach inside, live in
``bench/diagnostics/``. Checked statically with ``ast``: nothing is imported or run."""
from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("forge", "forge_triton", "forge_pallas", "bridge")
IMPORTERS = ("import_module", "__import__")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _library(dotted: str) -> bool:
    return dotted.split(".")[0] in LIBRARY


def _bad_path(dotted: str) -> bool:
    return _library(dotted) and any(_private(p) for p in dotted.split("."))


def _chain(node):
    """``a.b.c`` as ("a", ["b", "c"]), or None when the chain does not start at a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def _const_str(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _loop_values(tree) -> dict[str, list[str]]:
    """Names a loop or comprehension binds to each string of a literal tuple or list
    (``for m in ("a", "b")``): what an f-string naming a module may fill in."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, ast.Tuple | ast.List):
            vals = [_const_str(e) for e in node.iter.elts]
            if all(v is not None for v in vals):
                out.setdefault(node.target.id, []).extend(vals)
    return out


def _import_targets(call, loops) -> list[str] | None:
    """The modules a ``importlib.import_module("...")`` / ``__import__("...")`` call may name (an
    f-string: filled in from ``loops`` where it can be, else its literal parts), or None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in IMPORTERS or not call.args:
        return None
    arg = call.args[0]
    if not isinstance(arg, ast.JoinedStr):
        s = _const_str(arg)
        return None if s is None else [s]
    names = [""]
    for v in arg.values:
        if isinstance(v, ast.Constant):
            names = [n + v.value for n in names]
        elif isinstance(v.value, ast.Name) and v.value.id in loops:
            names = [n + x for n in names for x in loops[v.value.id]]
    return names


def violations(source: str, where: str = "<string>") -> list[str]:
    """Every use of a private library name in ``source`` (and in the Python its string
    constants hold, such as a child process's script)."""
    tree = _with_parents(ast.parse(source))
    loops = _loop_values(tree)
    bound: dict[str, str] = {}  # local name -> the library path it stands for
    out = []

    def bad(node, what):
        out.append(f"{where}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _bad_path(a.name):
                    bad(node, f"import {a.name}")
                if _library(a.name):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _library(node.module):
            if _bad_path(node.module):
                bad(node, f"from {node.module} import ...")
            for a in node.names:
                if _private(a.name):
                    bad(node, f"from {node.module} import {a.name}")
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Call):
            for target in _import_targets(node, loops) or ():
                if _bad_path(target.rstrip(".")):
                    bad(node, f"import_module({target!r})")
        elif isinstance(node, ast.Assign):
            # m = importlib.import_module("forge_triton.x"); a, b = (import_module(...) for ...)
            value = node.value
            if isinstance(value, ast.GeneratorExp | ast.ListComp) and isinstance(value.elt, ast.Call):
                names = [e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts
                         if isinstance(e, ast.Name)]
                found = _import_targets(value.elt, loops) or []
                if len(found) == len(names):
                    bound.update((n, t) for n, t in zip(names, found) if _library(t))
            elif isinstance(value, ast.Call):
                found = _import_targets(value, loops) or []
                if len(found) == 1 and _library(found[0]):
                    bound.update((t.id, found[0]) for t in node.targets if isinstance(t, ast.Name))
    # attribute chains from a library module or object: after the bindings are known
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr") \
                and len(node.args) > 1:
            obj, attr = _chain(node.args[0]), _const_str(node.args[1])
            if obj and obj[0] in bound and attr and _private(attr):
                bad(node, f"{node.func.id}({obj[0]}, {attr!r})")
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in bound:
                priv = [a for a in chain[1] if _private(a)]
                if priv:
                    bad(node, f"{chain[0]}.{'.'.join(chain[1])} ({bound[chain[0]]})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            code = textwrap.dedent(node.value)
            try:
                inner = ast.parse(code)
            except SyntaxError:
                continue
            if any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(inner)):
                out += violations(code, f"{where}:{node.lineno} (script in a string)")
    return sorted(set(out))


def _with_parents(tree):
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node
    return tree


BENCHMARKS = sorted((ROOT / "bench").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmark_uses_no_private_name(path):
    assert not violations(path.read_text(), path.name)


def test_the_benchmarks_users_run_are_at_the_top():
    names = {p.name for p in BENCHMARKS}
    for script in ("bench_backends.py", "bench_flce.py", "bench_patch_bisect.py", "bench_generate.py",
                   "bench_compile.py", "bench_guard.py", "bench_bridge_overhead.py", "bench_host_overhead.py",
                   "bench_first_call.py", "profile_step.py", "_common.py", "presets.py", "record.py"):
        assert script in names
    # one-off diagnostics live one folder down
    assert not [n for n in names if n.startswith(("diag_", "tune_")) or n.endswith("_host.py")]


@pytest.mark.parametrize("src, caught", [
    ("from bridge import core\ncore._import_fast(x)", "core._import_fast"),
    ("import bridge.native\nbridge.native._KERNELS.clear()", "bridge.native._KERNELS"),
    ("from forge.patching.graphs import _layer_op", "import _layer_op"),
    ("from forge_triton import _launch", "import _launch"),
    ("import forge_triton._common as c", "import forge_triton._common"),
    ("import importlib\nm = importlib.import_module('forge_triton._common')", "import_module"),
    ("import importlib\nm = importlib.import_module(f'forge_triton._{k}')", "import_module"),
    ("import importlib\nm = importlib.import_module('forge_triton.rmsnorm')\nm._fwd[(1,)]()", "m._fwd"),
    ("from forge_triton import rmsnorm\ngetattr(rmsnorm, '_fwd')", "getattr(rmsnorm, '_fwd')"),
    ("CHILD = '''\nfrom bridge import native\nprint(native._TRACES)\n'''", "script in a string"),
    ("CHILD = textwrap.dedent(\"\"\"\n    import forge\n    forge.ops._node('x', 'y')\n\"\"\")", "script in a string"),
    ("import importlib\nc, g = (importlib.import_module(f'forge_triton.{m}') for m in ('_common', 'glu'))",
     "forge_triton._common"),
    ("import importlib\nc, g = (importlib.import_module(f'forge_triton.{m}') for m in ('rmsnorm', 'glu'))\n"
     "g._fwd[1]()", "g._fwd"),
])
def test_the_checker_catches(src, caught):
    found = violations(src)
    assert any(caught in v for v in found), found


def test_the_checker_passes_public_use():
    src = ("import forge\nfrom forge import ops\nfrom bridge import native\nimport torch\n"
           "model._forge_graphs.stats\ntorch._dynamo.reset()\nnative.status()\nforge.__version__\n"
           "ops.get('rmsnorm', 'triton')\n")
    assert violations(src) == []
