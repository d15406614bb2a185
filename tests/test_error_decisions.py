"""No decision is made on an exception's text.

An error is told apart by its type and its fields (``isinstance``, ``e.rank``): its message is
for a person and may be reworded at any time. This test walks the syntax tree of every module
of the three packages and fails on a condition (``if``, ``while``, a conditional expression, an
``assert``, a comprehension's filter, a comparison, a boolean test within them) that reads an
exception's text: ``str(e)``, ``repr(e)``, ``format(e)``, ``e.args``, an f-string of ``e``, or
a name assigned from one of those, where ``e`` is bound by ``except ... as e`` (or assigned
from such a name). Formatting an exception into a message is fine.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nccl_ext", "prism_launch", "integrations")
_TEXT_CALLS = {"str", "repr", "format"}
_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.Tuple)
"""A container holding a message is not the message: testing it asks whether there is one."""


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.code}"


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _presence(n: ast.AST) -> bool:
    """``x is None``, ``x is not None``: whether there is a value, not what it says."""
    return isinstance(n, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops)


def _walk(expr: ast.AST):
    """``ast.walk`` that does not enter presence tests."""
    todo = [expr]
    while todo:
        n = todo.pop()
        if _presence(n):
            continue
        yield n
        todo.extend(ast.iter_child_nodes(n))


def _reads_text(expr: ast.AST, exc: set[str], text: set[str]) -> bool:
    """Whether ``expr`` reads the text of an exception variable (or a name holding it)."""
    for n in _walk(expr):
        if isinstance(n, ast.Name) and n.id in text:
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _TEXT_CALLS \
                and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id in exc:
            return True
        if isinstance(n, ast.Attribute) and n.attr in ("args", "__str__", "__repr__") \
                and isinstance(n.value, ast.Name) and n.value.id in exc:
            return True
        if isinstance(n, ast.FormattedValue) and isinstance(n.value, ast.Name) and n.value.id in exc:
            return True
    return False


def _bound(target: ast.AST) -> set[str]:
    """The plain names an assignment target binds (``a``, ``a, b``; not ``self.a`` or ``d[k]``)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_bound(t) for t in target.elts))
    return set()


def _assignments(scope: ast.AST):
    """(names bound, value) of every assignment to plain names in a scope."""
    for n in ast.walk(scope):
        if isinstance(n, ast.Assign):
            yield set().union(*(_bound(t) for t in n.targets)), n.value
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and n.value is not None:
            yield _bound(n.target), n.value


def _conditions(scope: ast.AST):
    for n in ast.walk(scope):
        if isinstance(n, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            yield n.test
        elif isinstance(n, ast.comprehension):
            yield from n.ifs
        elif isinstance(n, ast.Compare):
            yield n  # a comparison is a decision wherever it stands


def _scopes(tree: ast.Module):
    """The module and every function: exception names are tracked per scope (a nested
    function sees its enclosing scope's names too, as Python does)."""
    yield tree
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield n


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    tree = ast.parse(source)
    lines = source.splitlines()
    found: dict[int, Finding] = {}
    for scope in _scopes(tree):
        exc = {h.name for h in ast.walk(scope) if isinstance(h, ast.ExceptHandler) and h.name}
        if not exc:
            continue
        text: set[str] = set()
        while True:  # names assigned from an exception (an alias) or from its text, to a fixpoint
            grown = False
            for targets, value in _assignments(scope):
                if not targets:
                    continue
                if _reads_text(value, exc, text) and not isinstance(value, _CONTAINERS):
                    grown |= not targets <= text
                    text |= targets
                elif isinstance(value, (ast.Name, ast.BoolOp)) and _names(value) & exc:
                    grown |= not targets <= exc
                    exc |= targets
            if not grown:
                break
        for cond in _conditions(scope):
            if _reads_text(cond, exc, text):
                found.setdefault(cond.lineno, Finding(path, cond.lineno, lines[cond.lineno - 1].strip()))
    return sorted(found.values(), key=lambda f: f.line)


def _modules():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_no_decision_reads_an_exception_text():
    findings = [f for p in _modules() for f in check_source(p.read_text(), str(p.relative_to(ROOT)))]
    assert not findings, ("decided by an exception's text (decide by its type or fields: isinstance(e, ...), "
                          "e.rank; add a field or a subclass where none fits):\n"
                          + "\n".join(map(str, findings)))


def test_the_walk_covers_the_packages():
    paths = {str(p.relative_to(ROOT)) for p in _modules()}
    assert {"nccl_ext/frontend/process_group.py", "prism_launch/trace/fingerprint.py"} <= paths


PLANTED = {
    "startswith": """
        try:
            go()
        except RuntimeError as e:
            if str(e).startswith("rank 3:"):
                raise
        """,
    "in (conditional expression)": """
        def f(pending):
            try:
                go()
            except BaseException as err:
                pending.fail(err if pending.what in str(err) else RuntimeError(f"{pending.what}: {err}"))
        """,
    "args": """
        try:
            go()
        except OSError as e:
            ok = e.args[0] == 17
        """,
    "f-string": """
        try:
            go()
        except ValueError as exc:
            while "retry" in f"{exc}":
                go()
        """,
    "through a name": """
        def f():
            error = None
            try:
                go()
            except Exception as e:
                error = error or e
            text = repr(error).lower()
            return "timed out" in text
        """,
    "comprehension filter": """
        try:
            go()
        except KeyError as e:
            bad = [k for k in keys if k in format(e)]
        """,
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_the_checker_catches_a_planted_decision(name):
    findings = check_source(textwrap.dedent(PLANTED[name]))
    assert len(findings) == 1, (name, findings)


def test_the_checker_allows_formatting_and_typed_decisions():
    source = textwrap.dedent("""
        def f(pending, events):
            try:
                go()
            except RuntimeError as e:
                if isinstance(e, TimeoutError) or getattr(e, "rank", None) == 3:
                    raise
                first = next(iter(str(e).strip().splitlines()), type(e).__name__)
                raise RuntimeError(f"{pending.what}: {first} ({e!r})") from e
            for e in events:  # another name "e" in another function would not matter either
                log(f"{e}")
        """)
    assert check_source(source) == []
