"""Context-switched capture on one GPU with parking through the CUDA driver's checkpoint API.

    python bench/gpu_park.py [--ranks 8] [--ballast-gib 19] [--resident 7]

Captures ``bench/workers/gpu_park.py`` twice: (1) unparked, every rank resident, with 1 GiB of
ballast each; (2) with ``--ballast-gib`` each, so the ranks together need more than the card
holds, ``capture.park=cuda_checkpoint`` and ``capture.resident`` ranks on the device at once.
Prints capture times, checkpoint/restore counts and seconds, the card's size against the
ranks' total, and whether every rank's printed results are bit-identical between the two.
Exits 1 when a capture fails, a figure is missing, the ranks fit on the card without parking,
the results differ or a rank's ballast did not survive a resume.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import IS_TRUE, Figure, Goal, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "workers" / "gpu_park.py"


def capture(work: Path, name: str, ranks: int, ballast: float, extra: list[str]) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "prism_launch", "--nproc-per-node", str(ranks), "-r", "3", "--log-dir",
           str(out / "logs"), "device=cuda", "mode=capture", "launch.start_method=spawn", "memory.track=false",
           "comm.timeout_s=1800", f"trace.dir={out / 'trace'}", *extra, str(WORKER)]
    env = {**os.environ, "BALLAST_GIB": str(ballast), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=3000)
    print(r.stderr[-1500:], flush=True)
    if r.returncode != 0:
        raise SystemExit(f"{name} failed")
    stats = json.loads((out / "trace" / "capture.json").read_text())
    [d] = [p for p in (out / "logs").iterdir() if p.is_dir()]
    lines = {k: [ln.split(" allocated_gib")[0] for ln in (d / str(k) / "stdout.log").read_text().splitlines()
                 if ln.startswith(f"R{k} ")] for k in range(ranks)}
    return {"stats": stats, "lines": lines}


def figures(card_gib: float | None, ranks: int, ballast_gib: float, base: dict, parked: dict) -> list[Figure]:
    """The figures of the two captures: the parked ranks must need more than the card holds
    (else parking was not exercised), every rank's results bit-identical to the unparked
    capture's, and every rank's ballast intact after each resume (no lines: missing, not true)."""
    lines = [ln for v in parked["lines"].values() for ln in v]
    same = all(base["lines"].get(k) == parked["lines"].get(k) and base["lines"].get(k) for k in range(ranks))
    p, b = parked["stats"], base["stats"]
    need = ranks * ballast_gib
    return [Figure("card GiB", card_gib, fmt=".1f"),
            Figure("ranks' ballast GiB", need, None if card_gib is None else Goal(f"> card's {card_gib:.1f}",
                                                                                lambda v: v > card_gib), ".0f"),
            Figure("unparked capture s", b.get("wall_s"), fmt=".1f"),
            Figure("parked capture s", p.get("wall_s"), fmt=".1f"),
            Figure("parked resumes", p.get("resumes")),
            Figure("parking", p.get("parking")),
            Figure("results bit-identical to the unparked capture", same, IS_TRUE),
            Figure("ballast intact after every resume",
                   all("ballast_intact True" in ln for ln in lines) if lines else None, IS_TRUE)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--ballast-gib", type=float, default=19.0)
    ap.add_argument("--resident", type=int, default=6)
    a = ap.parse_args()
    import torch

    card = torch.cuda.get_device_properties(0).total_memory / 2**30
    work = Path(tempfile.mkdtemp(prefix="prism-gpu-park-"))
    base = capture(work, "unparked", a.ranks, 1.0, ["capture.park=none", f"capture.slots={a.ranks}"])
    parked = capture(work, "parked", a.ranks, a.ballast_gib,
                     ["capture.park=cuda_checkpoint", "capture.slots=1", f"capture.resident={a.resident}"])
    figs = {f.name: f for f in figures(card, a.ranks, a.ballast_gib, base, parked)}
    print(f"card: {card:.1f} GiB; ranks: {a.ranks} x {a.ballast_gib:g} GiB ballast = {a.ranks * a.ballast_gib:.0f} GiB")
    print(f"unparked capture (1 GiB each, all resident): {figs['unparked capture s'].shown()}s")
    print(f"parked capture: {figs['parked capture s'].shown()}s, slots 1, resident {a.resident}, resumes "
          f"{figs['parked resumes'].shown()}, parking "
          f"{'MISSING' if figs['parking'].missing else json.dumps(figs['parking'].value)}")
    print(f"results bit-identical to the unparked capture: {figs['results bit-identical to the unparked capture'].shown()}; "
          f"ballast intact after every resume: {figs['ballast intact after every resume'].shown()}")
    return report(figs.values())


if __name__ == "__main__":
    sys.exit(main())
