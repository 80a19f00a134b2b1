"""Every command the README shows runs as written (where a CPU can run it).

Each fenced code block in README.md carries a marker on the line before it:

    <!-- readme-test: run -->                  run it (python: as a script; bash: each command)
    <!-- readme-test: run; skip "PREFIX": WHY -->   bash: run each command except those starting
                                                with PREFIX (one clause per skipped command)
    <!-- readme-test: skip: WHY -->            not run, for the reason given
    <!-- readme-test: signature -->            API calls: each call's parameter names and defaults
                                                must be the function's own (inspect.signature)
    <!-- readme-test: output ... -->           the exact output of the python block above it,
                                                on a machine without CUDA

A block without a marker, an unknown marker or a skip clause that matches no command fails the
first test, so a new block cannot go untested silently.

Python blocks run in a fresh interpreter through tests/readme_shim.py, which maps a hub model id
the README names (``from_pretrained("Qwen/Qwen2.5-0.5B", ...)``) to a tiny random-weight model
of the same architecture, saved and loaded through ``from_pretrained`` with the block's own
arguments; nothing is downloaded (HF_HUB_OFFLINE=1). Bash commands run from the repository root.
Both import this checkout's forge (PYTHONPATH).
"""
from __future__ import annotations

import ast
import inspect
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->$")
SKIP_CLAUSE = re.compile(r'^skip "([^"]+)":\s*(\S.*)$')


@dataclass
class Block:
    line: int            # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None   # the marker's text after "readme-test:", None when absent

    @property
    def kind(self) -> str:
        return re.split(r"[;:\s]", self.marker, maxsplit=1)[0] if self.marker else ""

    def name(self) -> str:
        return f"README.md:{self.line}:{self.lang}"


def blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        prev = i - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        mk = MARKER.match(lines[prev].strip()) if prev >= 0 else None
        out.append(Block(i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n", mk.group(1) if mk else None))
        i = j + 1
    return out


def commands(text: str) -> list[str]:
    """The shell commands of a bash block: one per line and per ``&&``, comments dropped."""
    out = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out += [c.strip() for c in line.split("&&") if c.strip()]
    return out


def bash_plan(block: Block) -> list[tuple[str, str | None]]:
    """[(command, reason it is skipped or None)] for a bash block marked run[; skip ...]."""
    clauses = [c.strip() for c in block.marker.split(";")]
    assert clauses[0] == "run", f"{block.name()}: a bash marker starts with 'run' or 'skip:'"
    skips = {}
    for c in clauses[1:]:
        m = SKIP_CLAUSE.match(c)
        assert m, f"{block.name()}: bad clause {c!r} (want: skip \"PREFIX\": reason)"
        skips[m.group(1)] = m.group(2)
    plan = []
    for cmd in commands(block.text):
        hits = [p for p in skips if cmd.startswith(p)]
        plan.append((cmd, skips[hits[0]] if hits else None))
    unused = [p for p in skips if not any(c.startswith(p) for c, _ in plan)]
    assert not unused, f"{block.name()}: skip clauses that match no command: {unused}"
    return plan


BLOCKS = blocks()


def test_every_code_block_has_a_known_marker():
    assert BLOCKS, "no code blocks found in README.md"
    for b in BLOCKS:
        assert b.marker is not None, f"{b.name()}: no <!-- readme-test: ... --> marker on the line before it"
        assert b.kind in ("run", "skip", "signature", "output"), f"{b.name()}: unknown marker {b.marker!r}"
        if b.kind == "skip":
            assert re.match(r"^skip:\s*\S", b.marker), f"{b.name()}: a skip needs a reason (skip: WHY)"
        if b.kind == "run":
            assert b.lang in ("bash", "python"), f"{b.name()}: 'run' is for bash and python blocks"
            if b.lang == "bash":
                assert [c for c, why in bash_plan(b) if why is None], f"{b.name()}: runs nothing; mark it skip"
            else:
                assert b.marker == "run", f"{b.name()}: a python block runs whole"
        if b.kind == "output":
            k = BLOCKS.index(b)
            assert k > 0 and BLOCKS[k - 1].kind == "run" and BLOCKS[k - 1].lang == "python", \
                f"{b.name()}: an output block follows the python block it shows the output of"
    # the README keeps showing what users need first: a set-up command, a quickstart, the log
    kinds = {(b.lang, b.kind) for b in BLOCKS}
    assert {("bash", "run"), ("python", "run"), ("text", "output")} <= kinds, kinds


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("TRITON_INTERPRET", None)  # as a user's fresh shell: forge decides
    return env


def run_python(block: Block, tmp_path) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(block.text)
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "readme_shim.py"), str(script)], cwd=tmp_path,
                       env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert r.returncode == 0, f"{block.name()} failed:\n{block.text}\n--- output ---\n{r.stdout[-6000:]}"
    return r.stdout


PY_RUN = [b for b in BLOCKS if b.lang == "python" and b.kind == "run"]
BASH_RUN = [(b, c) for b in BLOCKS if b.lang == "bash" and b.kind == "run" for c, why in bash_plan(b) if why is None]


@pytest.mark.parametrize("block", PY_RUN, ids=[b.name() for b in PY_RUN])
def test_python_block_runs(block, tmp_path):
    out = run_python(block, tmp_path)
    k = BLOCKS.index(block)
    following = BLOCKS[k + 1] if k + 1 < len(BLOCKS) else None
    if following is not None and following.kind == "output":
        if torch.cuda.is_available():
            pytest.skip("the README shows this block's output on a machine without CUDA")
        assert out.rstrip() == following.text.rstrip(), (
            f"{following.name()} is not what {block.name()} prints now:\n{out}")


@pytest.mark.slow  # the demo: twelve model builds and patches in the interpreters, ~25 s on 2 cores
@pytest.mark.parametrize("block,cmd", BASH_RUN, ids=[f"{b.name()}:{c}" for b, c in BASH_RUN])
def test_bash_command_runs(block, cmd):
    argv = shlex.split(cmd)
    assert argv[0] == "python", f"{block.name()}: {cmd!r}: the test runs python commands only"
    r = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-6000:]}"
    if argv[1:3] == ["-m", "forge"]:
        # the demo: every architecture with every backend, unpatch exact, nothing that DIFFERS
        from forge.patching import arch

        rows = [ln.split()[0] for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in arch.SUPPORTED]
        assert set(rows) == set(arch.SUPPORTED), r.stdout
        assert "DIFFERS" not in r.stdout and "done in" in r.stdout, r.stdout


SIG_BLOCKS = [b for b in BLOCKS if b.kind == "signature"]


def _check_call(call: ast.Call, where: str):
    import forge  # noqa: F401  (the namespace the README's calls are written in)

    fn = eval(compile(ast.Expression(call.func), where, "eval"), {"forge": forge})
    if isinstance(call.func, ast.Call):  # forge.ops.get(...)(x, ...): check the inner call too
        _check_call(call.func, where)
    params = inspect.signature(fn).parameters
    if not all(isinstance(a, ast.Name) for a in call.args):  # literal arguments (a kernel key): a use
        return
    shown = [a.id for a in call.args]  # positional arguments are shown by their parameter's name
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert shown == [p.name for p in positional[:len(shown)]], f"{where}: {shown} vs {list(params)}"
    for kw in call.keywords:
        assert kw.arg in params, f"{where}: {fn.__qualname__} has no parameter {kw.arg!r}: {list(params)}"
        assert ast.literal_eval(kw.value) == params[kw.arg].default, \
            f"{where}: {kw.arg}={ast.unparse(kw.value)} but the default is {params[kw.arg].default!r}"
    named = set(shown) | {kw.arg for kw in call.keywords}
    left = [p.name for p in positional if p.name not in named]
    if call.keywords:  # a full signature: every parameter shown
        assert not left, f"{where}: {fn.__qualname__}'s parameters {left} are not in the README"


@pytest.mark.parametrize("block", SIG_BLOCKS, ids=[b.name() for b in SIG_BLOCKS])
def test_api_signatures_match_the_code(block):
    tree = ast.parse(block.text)
    calls = [s.value for s in tree.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]
    assert len(calls) == len(tree.body) and calls, f"{block.name()}: a signature block holds calls only"
    for call in calls:
        _check_call(call, f"{block.name()}: {ast.unparse(call)}")
