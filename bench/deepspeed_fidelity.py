"""The bundled DeepSpeed recipes at N ranks on CPU: a plain torchrun run vs prism-launch's
capture (max relative difference of every rank's loss, grad norm and parameter checksum), and
emulation of sandbox ranks vs the capture (bit-identical or not).

    OMP_NUM_THREADS=1 python bench/deepspeed_fidelity.py --ranks 8 --out /tmp/dsfid

Exits 1 when a run fails, a figure is missing (no logged values to compare) or a sandbox rank's
values are not bit-identical to the capture's.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import IS_TRUE, Figure, report  # noqa: E402

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


def max_rel_diff(real: list[list[dict]], captured: list[list[dict]]) -> float | None:
    """Largest relative difference of any value any rank logged in both runs (None: none compared)."""
    diffs = [abs(x[k] - y[k]) / max(1.0, abs(y[k]))
             for xs, ys in zip(real, captured, strict=True) for x, y in zip(xs, ys, strict=True) for k in x]
    return max(diffs) if diffs else None


def figures(rows: list[dict]) -> list[Figure]:
    """Per recipe: the runs' seconds, the torchrun-vs-capture difference, and each emulation's
    sandbox ranks bit-identical to the capture (``row["emulate"]``: {sandboxes: (same, seconds)})."""
    out = []
    for r in rows:
        name = r["recipe"]
        out += [Figure(f"{name} torchrun s", r.get("torchrun_s")), Figure(f"{name} capture s", r.get("capture_s")),
                Figure(f"{name} max rel diff torchrun vs capture", r.get("max_rel_diff_torchrun_vs_capture"))]
        for sb, (same, _t) in r["emulate"].items():
            out.append(Figure(f"{name} emulate {sb} bit-identical to the capture", same, IS_TRUE))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("ds_fidelity"))
    p.add_argument("--recipes", nargs="*", default=list(RECIPES))
    p.add_argument("--sandboxes", default="[5];[2,7]")
    a = p.parse_args()
    n, py = a.ranks, sys.executable
    rows, results = [], []
    for name in a.recipes:
        recipe, conf = RECIPES[name]
        d = (a.out / name).resolve()
        d.mkdir(parents=True, exist_ok=True)
        script = [EX / recipe, "--deepspeed", "--deepspeed_config", EX / "ds_configs" / conf, "--log-all-ranks"]
        t_real = run([py, "-m", "torch.distributed.run", "--nproc-per-node", n, "--log-dir", d / "torchrun",
                      "-r", "3", *script], d)
        t_cap = run([py, "-m", "prism_launch", "--num_gpus", n, "-r", "3", "device=cpu", "mode=capture",
                     f"trace.dir={d / 'trace'}", "--log-dir", d / "capture", *script], d)
        worst = max_rel_diff([lines(d / "torchrun", r) for r in range(n)], [lines(d / "capture", r) for r in range(n)])
        row = {"recipe": name, "ranks": n, "torchrun_s": round(t_real, 1), "capture_s": round(t_cap, 1),
               "max_rel_diff_torchrun_vs_capture": "MISSING" if worst is None else worst}
        checked = {**row, "max_rel_diff_torchrun_vs_capture": worst, "emulate": {}}
        for sb in a.sandboxes.split(";"):
            e = d / ("emu" + re.sub(r"\D+", "_", sb).strip("_"))
            t = run([py, "-m", "prism_launch", "--num_gpus", n, "-r", "3", "device=cpu", "mode=emulate",
                     f"trace.dir={d / 'trace'}", f"sandbox.ranks={sb}", f"report.dir={e / 'report'}",
                     "--log-dir", e / "logs", *script], d)
            ranks = json.loads(sb)
            same = all(lines(e / "logs", r) == lines(d / "capture", r) and len(lines(e / "logs", r)) >= 3
                       for r in ranks)
            row[f"emulate {sb}"] = f"{'bit-identical' if same else 'DIFFERS'} ({t:.1f}s)"
            checked["emulate"][sb] = (same, t)
        rows.append(row)
        results.append(checked)
        print(json.dumps(row), flush=True)
    (a.out / "summary.json").write_text(json.dumps(rows, indent=1))
    return report(figures(results))


if __name__ == "__main__":
    sys.exit(main())
