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
MOE_RECIPE = [EXAMPLES / "megatron_gpt.py", "--pipeline-model-parallel-size", "2", "--num-experts", "4",
              "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01", "--replicate-data",
              "--log-all-ranks"]
"""The bundled Megatron-core recipe as a PP2·EP2 MoE job, every replica on the same data."""

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


@pytest.fixture
def short_tmp():
    """A new directory with a short path under /tmp, for a launcher's TMPDIR: the coordinator's
    socket under a deep one (a parallel runner's) would not fit a Unix socket's path."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="pt-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def capture_each(tmp_path_factory, name: str, base: list, settings: dict[str, str], sandbox: int, program: list,
                 timeout: float = 900) -> dict[str, Path]:
    """One capture of ``program`` per value of the setting ``name`` (``{value: extra key=value}``),
    each in a directory of its own (its ``logs`` and ``trace``): asserts each succeeded."""
    out = {}
    for value, setting in settings.items():
        d = tmp_path_factory.mktemp(f"{name}-{value}")
        r = run_prism([*base, "--log-dir", d / "logs", "mode=capture", setting, f"sandbox.ranks=[{sandbox}]",
                       f"trace.dir={d / 'trace'}", *program], cwd=d, timeout=timeout)
        assert r.returncode == 0, r.stderr[-4000:]
        out[value] = d
    return out


def assert_emulation_bit_identical(base: list, captured: Path, sandbox: int, program: list, tmp_path: Path) -> None:
    """Emulating ``sandbox`` from the capture in ``captured`` (strict) logs exactly what the
    capture logged on that rank, with no divergence."""
    r = run_prism([*base, "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={captured / 'trace'}",
                   f"sandbox.ranks=[{sandbox}]", "emulate.strict=true", f"report.dir={tmp_path / 'report'}",
                   *program], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    emu = logged_metrics(rank_lines(tmp_path / "logs", sandbox))
    assert len(emu) >= 3 and emu == logged_metrics(rank_lines(captured / "logs", sandbox))
    import json

    assert json.loads((tmp_path / "report" / "report.json").read_text())["ranks"][str(sandbox)]["divergences"] == []


def rank_log_dirs(run_dir: Path) -> list[int]:
    """The ranks that logged under one run folder of ``--log-dir`` (the folder also holds the
    run's ``plan.json``, private to its owner)."""
    plan = run_dir / "plan.json"
    if plan.exists():
        assert plan.stat().st_mode & 0o077 == 0, oct(plan.stat().st_mode)
    return sorted(int(p.name) for p in run_dir.iterdir() if p.is_dir())
