"""The replay transport's helper modules use it through small declared interfaces: no free
function reaches into another object's private members, each interface names only what the
transport offers publicly, and DivergenceError is the communication layer's own."""

import ast
import inspect
from pathlib import Path

import pytest

from nccl_ext.core import errors
from nccl_ext.replay import checks, sandbox_peers, synthesized
from nccl_ext.replay.transport import DivergenceError, ReplayTransport

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ["nccl_ext/replay", "nccl_ext/capture", "nccl_ext/core", "prism_launch/capture"]


def _private_reaches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    out = []
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id not in ("self", "cls", *modules)):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    return out


def test_no_free_function_calls_another_objects_private_members():
    found = [hit for d in SCANNED for p in sorted((ROOT / d).glob("*.py")) for hit in _private_reaches(p)]
    assert not found, "free functions reaching into private members:\n" + "\n".join(found)


@pytest.mark.parametrize("interface", [synthesized.SynthesizingRank, checks.CheckingRank, sandbox_peers.PeeringRank],
                         ids=lambda c: c.__name__)
def test_each_interface_names_only_public_members_of_the_transport(interface):
    names = [n for n in {*interface.__annotations__, *vars(interface)} if not n.startswith("_")]
    assert names
    methods = [n for n in names if inspect.isfunction(vars(interface).get(n))]
    for n in methods:
        assert callable(getattr(ReplayTransport, n, None)), f"ReplayTransport has no public {n}()"
    src = inspect.getsource(ReplayTransport.__init__)
    for n in set(names) - set(methods):
        assert f"self.{n} =" in src or f"self.{n}:" in src, f"ReplayTransport sets no public {n}"


def test_divergence_error_is_the_communication_layers():
    assert DivergenceError is errors.DivergenceError and issubclass(DivergenceError, errors.CommError)
