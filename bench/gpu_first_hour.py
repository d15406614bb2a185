"""The first hour with upstream Megatron-LM ``pretrain_gpt.py`` (unchanged) on one GPU: output-only
arguments and a refused computation change, as a user would type them.

    source .mlm/activate.sh && python bench/gpu_first_hour.py [--world 1024] [--ckpt-format torch_dist]

1. capture with ``--save run1/ckpt --tensorboard-dir run1/tb`` (a checkpoint is written at the
   last iteration);
2. emulate the same command line with ``--save run2/ckpt --tensorboard-dir run2/tb``: accepted
   (Megatron-LM's output-only flags, ``integrations/megatron_flags.py``), the sandbox's losses
   equal the capture's, and the sandbox writes its checkpoint shards under ``run2/ckpt``;
3. emulate with ``--hidden-size`` changed: refused before any rank starts, naming the argument
   and ``trace.ignore_args``.

Prints each command line, its exit code and the launcher's lines, the losses of both runs, the
files each run's ``--save`` holds, and the refusal. Exits non-zero when a step does not behave
as described.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from upstream import MODEL_84M, pretrain_gpt  # noqa: E402

MODEL = [*MODEL_84M, "--save-interval", "1000"]
_LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")


def run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    shown = " ".join(str(a) for a in args).replace(str(cwd) + "/", "")
    print(f"\n$ prism-launch {shown}", flush=True)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=900)
    print(f"  exit {r.returncode} after {time.monotonic() - t0:.0f}s", flush=True)
    for line in r.stderr.splitlines():
        if line.startswith("prism-launch"):
            print(f"  {line[:600]}", flush=True)
    if r.returncode not in (0, 2) and "prism-launch: error" not in r.stderr:
        print(r.stderr[-3000:], flush=True)
    return r


def losses(log_dir: Path, rank: int) -> list[str]:
    out = []
    for path in sorted(log_dir.glob(f"*/{rank}/stdout.log")):
        out += _LOSS.findall(path.read_text(errors="replace"))
    return out


def files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()) if d.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--ckpt-format", default="torch_dist")
    ap.add_argument("--mlm", default=str(ROOT / ".mlm"))
    a = ap.parse_args()
    script = pretrain_gpt(a.mlm)
    if script is None:
        return 2
    work = Path(tempfile.mkdtemp(prefix="prism-first-hour-"))
    sandbox = a.world - 1  # Megatron prints its iteration line on the last rank only
    job = [*MODEL, "--global-batch-size", str(2 * a.world), "--train-iters", str(a.iters),
           "--ckpt-format", a.ckpt_format]
    base = ["--nnodes", str(a.world // 8), "--nproc-per-node", "8", "device=cuda", f"sandbox.ranks=[{sandbox}]",
            "trace.dir=trace"]
    bad: list[str] = []
    try:
        print(f"upstream pretrain_gpt.py, {a.world} ranks (data parallel), sandbox {sandbox}, "
              f"checkpoint format {a.ckpt_format}", flush=True)
        r1 = run([*base, "--log-dir", "logs1", "mode=capture", script, *job,
                  "--save", "run1/ckpt", "--tensorboard-dir", "run1/tb"], work)
        if r1.returncode != 0:
            bad.append(f"capture exited {r1.returncode}")
            return 1
        r2 = run([*base, "--log-dir", "logs2", "mode=emulate", "report.dir=report", script, *job,
                  "--save", "run2/ckpt", "--tensorboard-dir", "run2/tb"], work)
        cap, emu = losses(work / "logs1", sandbox), losses(work / "logs2", sandbox)
        print(f"  losses, capture:   {cap}\n  losses, emulation: {emu}", flush=True)
        print(f"  run1/ckpt (capture, {len(files(work / 'run1' / 'ckpt'))} files): "
              f"{files(work / 'run1' / 'ckpt')[:6]}", flush=True)
        print(f"  run2/ckpt (emulation, sandbox {sandbox} only, {len(files(work / 'run2' / 'ckpt'))} files): "
              f"{files(work / 'run2' / 'ckpt')[:6]}", flush=True)
        if r2.returncode != 0:
            bad.append(f"emulation with other --save/--tensorboard-dir exited {r2.returncode}")
        elif not cap or cap != emu:
            bad.append("the emulation's losses differ from the capture's")
        changed = [*job]
        changed[changed.index("--hidden-size") + 1] = "1536"
        r3 = run([*base, "--log-dir", "logs3", "mode=emulate", "report.dir=report3", script, *changed,
                  "--save", "run3/ckpt", "--tensorboard-dir", "run3/tb"], work)
        if r3.returncode == 0 or "--hidden-size" not in r3.stderr or "trace.ignore_args" not in r3.stderr:
            bad.append(f"--hidden-size changed: exit {r3.returncode}, expected a refusal naming it and trace.ignore_args")
    finally:
        for b in bad:
            print(f"FAILED: {b}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
