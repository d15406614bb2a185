"""Shared helpers: run prism-launch / torchrun as a user would, with bounded time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"
EXAMPLES = ROOT / "examples"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    extra = dict(extra or {})
    if "PYTHONPATH" in extra:
        env["PYTHONPATH"] = os.pathsep.join((extra.pop("PYTHONPATH"), env["PYTHONPATH"]))
    env.update(extra)
    return env


def run_prism(args: list[str], *, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None):
    """``prism-launch ARGS`` in a subprocess; returns the CompletedProcess (text)."""
    cmd = [sys.executable, "-m", "prism_launch", *[str(a) for a in args]]
    return subprocess.run(cmd, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=timeout)


def run_torchrun(args: list[str], *, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", *[str(a) for a in args]]
    return subprocess.run(cmd, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=timeout)


def rank_lines(log_dir: Path, rank: int, prefix: str = "") -> list[str]:
    """Lines of one rank's stdout log (the single run directory under ``log_dir``)."""
    [run_dir] = [p for p in log_dir.iterdir() if p.is_dir()]
    text = (run_dir / str(rank) / "stdout.log").read_text()
    return [line for line in text.splitlines() if line.startswith(prefix)]


_NUM = re.compile(r"(loss|grad_norm|param_checksum) (\S+)")


def logged_metrics(lines: list[str]) -> list[dict]:
    """Per logged line of a recipe: its numeric fields (step_time_ms excluded: wall clock)."""
    out = []
    for line in lines:
        fields = dict(_NUM.findall(line))
        if fields:
            out.append({k: float(v) for k, v in fields.items()} | {"head": line.split("|")[0].strip()})
    return out


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path
