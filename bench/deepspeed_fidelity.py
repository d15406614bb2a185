"""The bundled DeepSpeed recipes at N ranks on CPU: a plain torchrun run vs prism-launch's
capture (max relative difference of every rank's loss, grad norm and parameter checksum), and
emulation of sandbox ranks vs the capture (bit-identical or not).

    OMP_NUM_THREADS=1 python bench/deepspeed_fidelity.py --ranks 8 --out /tmp/dsfid
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"
RECIPES = {
    "zero1": ("deepspeed_gpt.py", "zero1.json"),
    "zero2": ("deepspeed_gpt.py", "zero2.json"),
    "zero3": ("deepspeed_gpt.py", "zero3.json"),
    "pipe": ("deepspeed_pipe.py", "pipe.json"),
    "moe": ("deepspeed_moe.py", "moe.json"),
}
_NUM = re.compile(r"(loss|grad_norm|param_checksum) (\S+)")


def lines(log_dir: Path, rank: int) -> list[dict]:
    [path] = list(log_dir.glob(f"**/{rank}/stdout.log"))  # prism: RUN/R/; torchrun: RUN/attempt_0/R/
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("rank "):
            out.append({k: float(v) for k, v in _NUM.findall(line)})
    return out


def run(cmd, cwd: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    t0 = time.monotonic()
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{r.stderr[-3000:]}")
    return time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("ds_fidelity"))
    p.add_argument("--recipes", nargs="*", default=list(RECIPES))
    p.add_argument("--sandboxes", default="[5];[2,7]")
    a = p.parse_args()
    n, py = a.ranks, sys.executable
    rows = []
    for name in a.recipes:
        recipe, conf = RECIPES[name]
        d = (a.out / name).resolve()
        d.mkdir(parents=True, exist_ok=True)
        script = [EX / recipe, "--deepspeed", "--deepspeed_config", EX / "ds_configs" / conf, "--log-all-ranks"]
        t_real = run([py, "-m", "torch.distributed.run", "--nproc-per-node", n, "--log-dir", d / "torchrun",
                      "-r", "3", *script], d)
        t_cap = run([py, "-m", "prism_launch", "--num_gpus", n, "-r", "3", "device=cpu", "mode=capture",
                     f"trace.dir={d / 'trace'}", "--log-dir", d / "capture", *script], d)
        worst = 0.0
        for r in range(n):
            for x, y in zip(lines(d / "torchrun", r), lines(d / "capture", r), strict=True):
                for k in x:
                    worst = max(worst, abs(x[k] - y[k]) / max(1.0, abs(y[k])))
        row = {"recipe": name, "ranks": n, "torchrun_s": round(t_real, 1), "capture_s": round(t_cap, 1),
               "max_rel_diff_torchrun_vs_capture": worst}
        for sb in a.sandboxes.split(";"):
            e = d / ("emu" + re.sub(r"\D+", "_", sb).strip("_"))
            t = run([py, "-m", "prism_launch", "--num_gpus", n, "-r", "3", "device=cpu", "mode=emulate",
                     f"trace.dir={d / 'trace'}", f"sandbox.ranks={sb}", f"report.dir={e / 'report'}",
                     "--log-dir", e / "logs", *script], d)
            ranks = json.loads(sb)
            same = all(lines(e / "logs", r) == lines(d / "capture", r) and len(lines(e / "logs", r)) >= 3
                       for r in ranks)
            row[f"emulate {sb}"] = f"{'bit-identical' if same else 'DIFFERS'} ({t:.1f}s)"
        rows.append(row)
        print(json.dumps(row), flush=True)
    (a.out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
