"""What a trace is keyed by: the config that shapes the program, the script, its
arguments and the library versions. Emulation refuses a trace whose fingerprint
differs and names what differs."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import platform
from pathlib import Path

PACKAGES = ("torch", "megatron-core", "deepspeed", "prism-launch")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def module_origin(name: str) -> str | None:
    """The file ``python -m name`` runs, found without importing ``name``'s parent packages:
    ``importlib.util.find_spec`` executes every parent's ``__init__`` in the launcher (a heavy
    framework import, and one that can fail there: ``torchtitan``'s imports Triton, which a
    CPU-only torch lacks, before a rank's compatibility layer can stand in for it). Falls back
    to ``find_spec`` for top-level packages only another finder knows (editable installs, zip
    imports)."""
    import importlib.machinery
    import sys

    parts = name.split(".")
    spec, search = None, None
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        loaded = sys.modules.get(full)
        spec = getattr(loaded, "__spec__", None) or importlib.machinery.PathFinder.find_spec(full, search)
        if spec is None:
            # a top-level package only another finder knows; a submodule missing from its found
            # package's folders is missing (without running the package to say so)
            spec = importlib.util.find_spec(name) if i == 0 else None
            break
        search = spec.submodule_search_locations
    return None if spec is None else spec.origin


def script_digest(script: str, *, module: bool) -> str:
    path: Path | None = None
    if module:
        origin = module_origin(script)
        if origin is None:
            raise FileNotFoundError(f"module {script!r} not found (python -m {script} would fail too)")
        path = Path(origin)
    else:
        path = Path(script)
        if not path.exists():
            import shutil

            found = shutil.which(script)
            if found is None:
                raise FileNotFoundError(f"training script {script!r} not found")
            path = Path(found)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(*, program_config: dict, script: str, module: bool, args: list[str]) -> dict[str, str]:
    return {
        "config": _digest(program_config),
        "script": script_digest(script, module=module),
        "args": _digest(list(args)),
        "versions": _digest(versions()),
    }


def combined(fp: dict[str, str]) -> str:
    return _digest(fp)[:12]
