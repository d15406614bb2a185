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


def script_digest(script: str, *, module: bool) -> str:
    path: Path | None = None
    if module:
        spec = importlib.util.find_spec(script)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"module {script!r} not found (python -m {script} would fail too)")
        path = Path(spec.origin)
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
