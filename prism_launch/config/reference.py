"""The configuration reference, generated from the config dataclasses: every field of
:class:`~prism_launch.config.root.PrismConfig` (and of the ``cluster`` presets' schema) with
its type, default and the attribute docstring written under it in ``prism_launch/config/*.py``.

``prism-launch --help-config [SECTION]`` prints it as text; ``python -m
prism_launch.config.reference > docs/configuration.md`` writes the Markdown page, which a test
regenerates and compares. The docstrings are the one source: edit them, not the page.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache

__all__ = ["Field", "attribute_docs", "fields_of", "markdown", "missing_docs", "text", "REGENERATE"]

REGENERATE = "python -m prism_launch.config.reference > docs/configuration.md"
"""The command that writes ``docs/configuration.md``; the page's first line names it."""


@dataclass(frozen=True, slots=True)
class Field:
    """One configurable key of the reference."""

    key: str
    """Dotted override name, e.g. ``capture.payload``."""
    type: str
    """The field's type in words (``int``, ``list of str``, an enum's choices …)."""
    default: str
    """The default as an override would spell it (``null`` for unset)."""
    doc: str
    """The field's attribute docstring, dedented."""
    choices: tuple[tuple[str, str], ...] = ()
    """An enum field's values with each value's own docstring."""


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """``{name: docstring}`` of the string literals written right under a class's attribute
    assignments (the convention every config dataclass and enum of this package follows)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            out[name] = inspect.cleandoc(nxt.value.value)
    return out


def missing_docs(cls: type) -> list[str]:
    """Fields of dataclass ``cls`` (members of enum ``cls``) without an attribute docstring."""
    docs = attribute_docs(cls)
    names = [m.name for m in cls] if isinstance(cls, enum.EnumMeta) else [f.name for f in dataclasses.fields(cls)]
    return [n for n in names if not docs.get(n, "").strip()]


def _type_words(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_words(a) for a in inner) + ", or null"
    if origin in (list, tuple):
        return f"list of {_type_words(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if isinstance(tp, enum.EnumMeta):
        return " | ".join(m.value for m in tp)
    if tp is typing.Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _spell(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_spell(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def _enum_of(tp) -> type[enum.Enum] | None:
    if isinstance(tp, enum.EnumMeta):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if isinstance(a, enum.EnumMeta):
                return a
    return None


def _section_type(tp) -> type | None:
    return tp if dataclasses.is_dataclass(tp) and isinstance(tp, type) else None


def fields_of(cls: type, prefix: str = "", *, preset: bool = False) -> list[Field]:
    """Every leaf field of dataclass ``cls`` under ``prefix``, nested sections flattened."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    out: list[Field] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        section = _section_type(tp)
        if section is not None:
            out += fields_of(section, key + ".", preset=preset or section.__name__ == "ClusterSpec")
            continue
        if f.default is not dataclasses.MISSING:
            default = _spell(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _spell(f.default_factory())
        else:
            default = "from the cluster preset" if preset else "required"
        if preset and f.default is not dataclasses.MISSING:
            default += " (unless the preset sets it)"
        kind = _enum_of(tp)
        choices = tuple((m.value, attribute_docs(kind).get(m.name, "")) for m in kind) if kind else ()
        out.append(Field(key=key, type=_type_words(tp), default=default, doc=docs.get(f.name, ""), choices=choices))
    return out


def _all_fields() -> list[Field]:
    from prism_launch.config.root import PrismConfig

    return fields_of(PrismConfig)


def _section(key: str) -> str:
    return key.split(".", 1)[0] if "." in key else "general"


def select(section: str | None) -> list[Field]:
    """The fields of ``section``: a dotted prefix (``capture``, ``emulate.prefetch``), a key, or
    ``general`` (the top-level keys); None: all. Raises ``KeyError`` naming the sections."""
    fields = _all_fields()
    if not section:
        return fields
    section = section.strip().rstrip(".")
    picked = [f for f in fields if (_section(f.key) == "general" and section == "general")
              or f.key == section or f.key.startswith(section + ".")]
    if not picked:
        known = sorted({_section(f.key) for f in fields})
        raise KeyError(f"no config section or key {section!r} (sections: {', '.join(known)})")
    return picked


def _md_inline(doc: str) -> str:
    """Docstring markup (reST ``literal``, :role:`target`) as Markdown."""
    doc = re.sub(r":(?:class|mod|func|meth|attr|data):`~?([^`]+)`", r"`\1`", doc)
    return doc.replace("``", "`")


def _plain(doc: str) -> str:
    return re.sub(r":(?:class|mod|func|meth|attr|data):`~?([^`]+)`", r"\1", doc).replace("``", "")


def _paragraphs(doc: str) -> list[str]:
    return [" ".join(p.split()) for p in doc.split("\n\n") if p.strip()]


_SECTION_INTRO = {
    "general": "Top-level keys.",
    "cluster": "The target machine room, a Hydra group: `cluster=h100_ib` (also `h200_ib`, `a100_ib`, "
               "`gb200_nvl72`, `cpu_local`, the default with `device=cpu`) selects a preset from "
               "`configs/cluster/`; `cluster.KEY=V` overrides one of its fields.",
}


def markdown() -> str:
    """The whole reference as the Markdown of ``docs/configuration.md``."""
    lines = [f"<!-- Generated from the config dataclasses' docstrings: `{REGENERATE}`. Do not edit by hand. -->",
             "", "# Configuration reference", "",
             "Every key is set on the command line as `key=value` (Hydra syntax) before the script, "
             "e.g. `prism-launch --nproc-per-node 8 capture.payload=full train.py`. "
             "`prism-launch --help-config SECTION` prints one section in the terminal; "
             "`prism-launch --cfg ...` prints the composed values of a run.", ""]
    current = None
    for f in _all_fields():
        sec = _section(f.key)
        if sec != current:
            current = sec
            lines += [f"## {sec}", ""]
            if sec in _SECTION_INTRO:
                lines += [_SECTION_INTRO[sec], ""]
        lines += [f"### `{f.key}`", "", f"*{_md_inline(f.type)}* · default `{f.default}`", ""]
        lines += [p for para in _paragraphs(_md_inline(f.doc)) for p in (para, "")]
        for value, doc in f.choices:
            line = " ".join(_md_inline(doc).split())
            lines.append(f"- `{value}`" + (f": {line}" if line else ""))
        if f.choices:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def text(section: str | None = None, width: int = 100) -> str:
    """The reference (or one section of it) as terminal text."""
    out: list[str] = []
    wrap = textwrap.TextWrapper(width=width, initial_indent="    ", subsequent_indent="    ")
    choice = textwrap.TextWrapper(width=width, initial_indent="      ", subsequent_indent="        ")
    for f in select(section):
        out.append(f"{f.key} = {f.default}    [{f.type}]")
        for para in _paragraphs(_plain(f.doc)):
            out += wrap.wrap(para)
        for value, doc in f.choices:
            out += choice.wrap(f"{value}: {' '.join(_plain(doc).split())}" if doc.strip() else value)
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        try:
            sys.stdout.write(text(args[0]))
        except KeyError as e:
            print(f"prism-launch: error: {e.args[0]}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
