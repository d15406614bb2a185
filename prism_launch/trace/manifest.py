"""The manifest of a PrismTrace (``manifest.json``): the :class:`Manifest` dataclass, its JSON
(de)serialisation, and the validation of every field, both of a manifest read back and of
the values a writer is asked to commit."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Manifest", "manifest_fields", "is_intlike"]

_REQUIRED = (
    "format_version",
    "created_unix",
    "fingerprint",
    "versions",
    "world_size",
    "topology",
    "groups",
    "ranks_captured",
    "files",
)


def is_intlike(x: Any) -> bool:
    """An integer of any kind (``int``, numpy, torch), but not a ``bool``."""
    return not isinstance(x, bool) and hasattr(x, "__index__")


def _check_str_dict(name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of str -> str, got {type(value).__name__}")
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"{name} must map str -> str; entry {k!r}: {v!r} is not")
        out[k] = v
    return out


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def _as_int(name: str, value: Any) -> int:
    """Like ``_check_int``, but any integer kind is taken as an int."""
    return _check_int(name, int(value) if is_intlike(value) else value)


def _optional_count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if _check_int(name, value) < 0:
        raise ValueError(f"{name} must not be negative, got {value}")
    return value


def _check_json_dict(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    return dict(value)


def _normalize_group(g: Any, i: int) -> dict[str, Any]:
    if not isinstance(g, Mapping):
        raise TypeError(f"groups[{i}] must be a dict with id, ranks, backend, desc; got {g!r}")
    if "id" not in g or "ranks" not in g:
        raise ValueError(f"groups[{i}] must have 'id' and 'ranks'; got keys {sorted(g)}")
    out = dict(g)
    out["id"] = _check_int(f"groups[{i}].id", g["id"])
    ranks = g["ranks"]
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"groups[{i}].ranks must be a list of ints, got {ranks!r}")
    if isinstance(ranks, list) and set(map(type, ranks)) <= {int}:
        out["ranks"] = list(ranks)  # plain ints (every JSON-read manifest): checked at C speed
    else:
        out["ranks"] = [_as_int(f"groups[{i}].ranks[]", r) for r in ranks]
    backend = g.get("backend", "")
    desc = g.get("desc", "")
    if not isinstance(backend, str) or not isinstance(desc, str):
        raise TypeError(f"groups[{i}].backend and .desc must be strings")
    out["backend"] = backend
    out["desc"] = desc
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Contents of ``manifest.json``."""

    format_version: int
    created_unix: float
    fingerprint: dict[str, str]
    versions: dict[str, str]
    world_size: int
    topology: dict[str, Any]
    groups: list[dict[str, Any]]
    ranks_captured: list[int]
    files: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)
    event_rows: int | None = None
    """Rows of ``events.parquet``, checked against the file's footer before it is read
    (None: a trace written before it was recorded)."""
    event_bytes: int | None = None
    """Uncompressed bytes of ``events.parquet``'s row groups (its footer's sum), checked likewise."""

    def to_dict(self) -> dict[str, Any]:
        limits = {k: v for k, v in (("event_rows", self.event_rows), ("event_bytes", self.event_bytes))
                  if v is not None}
        return limits | {
            "format_version": self.format_version,
            "created_unix": self.created_unix,
            "fingerprint": dict(self.fingerprint),
            "versions": dict(self.versions),
            "world_size": self.world_size,
            "topology": self.topology,
            "groups": [dict(g) for g in self.groups],
            "ranks_captured": list(self.ranks_captured),
            "files": dict(self.files),
            "extra": self.extra,
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True, allow_nan=False)

    def canonical_bytes(self) -> bytes:
        """The manifest as one canonical byte string (sorted keys, no whitespace, ASCII): what a
        signature covers (:mod:`.signing`), the same for a manifest written and read back."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False,
                          ensure_ascii=True).encode("ascii")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        """Build a manifest from parsed JSON; raises ``TypeError``/``ValueError`` if malformed."""
        if not isinstance(d, Mapping):
            raise TypeError(f"manifest must be a JSON object, got {type(d).__name__}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"manifest lacks fields {missing}")
        created = d["created_unix"]
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            raise TypeError(f"created_unix must be a number, got {created!r}")
        groups = d["groups"]
        if not isinstance(groups, list):
            raise TypeError("groups must be a list")
        ranks = d["ranks_captured"]
        if not isinstance(ranks, list):
            raise TypeError("ranks_captured must be a list of ints")
        extra = d.get("extra", {})
        if extra is None:
            extra = {}
        return cls(
            format_version=_check_int("format_version", d["format_version"]),
            created_unix=float(created),
            fingerprint=_check_str_dict("fingerprint", d["fingerprint"]),
            versions=_check_str_dict("versions", d["versions"]),
            world_size=_check_int("world_size", d["world_size"]),
            topology=_check_json_dict("topology", d["topology"]),
            groups=[_normalize_group(g, i) for i, g in enumerate(groups)],
            ranks_captured=[_check_int("ranks_captured[]", r) for r in ranks],
            files=_check_str_dict("files", d["files"]),
            extra=_check_json_dict("extra", extra),
            event_rows=_optional_count("event_rows", d.get("event_rows")),
            event_bytes=_optional_count("event_bytes", d.get("event_bytes")),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        return cls.from_dict(json.loads(text))


def manifest_fields(fingerprint: Any, versions: Any, world_size: Any, topology: Any, groups: Any,
                    ranks_captured: Any, extra: Any) -> dict[str, Any]:
    """The values a writer is asked to commit (as :meth:`TraceWriter.commit` takes them),
    checked and normalised into the keyword arguments of :class:`Manifest` (all but
    ``format_version``, ``created_unix`` and ``files``); ``ranks_captured`` comes back
    sorted and without repeats, ``extra`` None as empty. Raises ``TypeError``/``ValueError``."""
    fingerprint = _check_str_dict("fingerprint", fingerprint)
    versions = _check_str_dict("versions", versions)
    world_size = _as_int("world_size", world_size)
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    topology = _check_json_dict("topology", topology)
    groups_n = [_normalize_group(g, i) for i, g in enumerate(groups)]
    ranks = sorted({_as_int("ranks_captured[]", r) for r in ranks_captured})
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks_captured {bad} are outside [0, world_size={world_size})")
    extra_d = _check_json_dict("extra", extra if extra is not None else {})
    for name, obj in (("topology", topology), ("groups", groups_n), ("extra", extra_d)):
        try:
            json.dumps(obj, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} is not JSON-serializable: {e}") from e
    return {
        "fingerprint": fingerprint,
        "versions": versions,
        "world_size": world_size,
        "topology": topology,
        "groups": groups_n,
        "ranks_captured": ranks,
        "extra": extra_d,
    }
