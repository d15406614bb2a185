"""The architecture as checked facts: the layering contract of ``pyproject.toml``
(import-linter), no import circle between modules, no module too long to read in one
sitting without saying why, and one variable between the launcher and a rank."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prism_launch", "nccl_ext", "integrations")
MAX_LINES = 600
LONG_REASON = "Why this module is long:"
"""A module over MAX_LINES says this in its docstring, followed by the reason."""


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def test_import_linter_contracts_are_kept():
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                        "sys.exit(lint_imports_command())"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and r.stdout.count("KEPT") >= 4, r.stdout[-2000:]


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_no_import_circle_between_modules():
    graph = grimp.build_graph(*PACKAGES)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "circ"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from circ import b\n")
    (pkg / "b.py").write_text("def f():\n    from circ import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("circ")) == [["circ.a", "circ.b"]]


def test_no_module_over_the_limit_without_a_reason():
    long = {}
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if LONG_REASON not in doc:
                long[name] = lines
    assert long == {}, f"modules over {MAX_LINES} lines whose docstring does not say '{LONG_REASON} ...': {long}"


RANK_SIDE = ("prism_launch/rank", "prism_launch/launch/devices.py", "nccl_ext")


def test_rank_side_reads_only_the_plan_variable():
    """No rank-side module reads a PRISM_* variable of its own: the plan is the contract."""
    names = set()
    for entry in RANK_SIDE:
        base = ROOT / entry
        for path in [base] if base.is_file() else base.rglob("*.py"):
            names |= set(re.findall(r"PRISM_[A-Z_]+", path.read_text()))
    assert names <= {"PRISM_PLAN"}, names
    plan = (ROOT / "prism_launch/config/plan.py").read_text()
    assert set(re.findall(r"\"(PRISM_[A-Z_]+)\"", plan)) == {"PRISM_PLAN"}
