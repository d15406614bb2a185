"""One tensor-parallel rank's compute of the 8B job, run for real on one GPU, against what the
8B prediction's calibration measured for it.

A rank of the Llama-3-8B-shaped job at TP8·PP4 (``bench/gpu_predict8b.py``) runs, per step, 8
micro-batches through 8 layers of which it holds 4 of 32 query heads (128 wide), 1 of 8 query
groups and 1,792 of the 14,336 SwiGLU units. The same GEMM shapes at world size 1 are upstream
``pretrain_gpt.py`` with ``--num-layers 8 --num-attention-heads 4 --kv-channels 128
--num-query-groups 1 --ffn-hidden-size 1792`` (hidden 4096, seq 4096, micro-batch 1, global batch
8, a 1,024-token vocabulary so the embedding and logits are negligible, as on a middle stage):
everything but the tensor-parallel all-reduces.

    source .mlm/activate.sh && python bench/gpu_tp_shard.py [--iters 6] [--out f.json]

Prints Megatron's own time per iteration under plain ``torchrun`` and under ``prism-launch``
(``mode=auto``: capture, calibration, emulation of the one rank), and the prediction of that
world-1 job on ``h200_ib`` (the measuring GPU: nothing scaled). A middle stage's calibrated
compute in the 8B prediction is compared against the plain run by hand (printed by
``gpu_predict8b.py`` per rank). Exits non-zero when a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from figures import Figure, report  # noqa: E402


def job(iters: int) -> list[str]:
    return ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "4", "--kv-channels", "128",
            "--group-query-attention", "--num-query-groups", "1", "--ffn-hidden-size", "1792", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--seq-length", "4096", "--max-position-embeddings", "4096",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", str(iters), "--bf16",
            "--lr", "1e-4", "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1024", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-persist-layer-norm", "--no-rope-fusion", "--no-bias-swiglu-fusion", "--log-interval", "1",
            "--eval-interval", "100000", "--eval-iters", "0"]


def steady_ms(text: str) -> float | None:
    """Median of Megatron's "elapsed time per iteration" after the first two iterations."""
    its = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    return statistics.median(its[2:]) if len(its) > 2 else None


def run(cmd: list[str], cwd: Path, timeout: float) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout:.0f} s: {' '.join(cmd[:6])} ...", file=sys.stderr)
        return ""
    if r.returncode != 0:
        print(f"exit {r.returncode}: {' '.join(cmd[:6])} ...\n{r.stderr[-3000:]}", file=sys.stderr)
    return r.stdout + r.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--mlm", default=str(ROOT / ".mlm"))
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from upstream import pretrain_gpt

    script = pretrain_gpt(a.mlm)
    if script is None:
        return 2
    work = Path(tempfile.mkdtemp(prefix="prism-shard-"))
    res: dict = {}
    try:
        plain = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(script), *job(a.iters)],
                    work, a.timeout)
        res["torchrun_ms"] = steady_ms(plain)
        logs = work / "logs"
        run([sys.executable, "-m", "prism_launch", "--nproc-per-node", "1", "--log-dir", str(logs), "device=cuda",
             "cluster=h200_ib", f"trace.dir={work / 'trace'}", f"report.dir={work / 'report'}", "mode=auto",
             "calibrate.in_auto=true", str(script), *job(a.iters)], work, a.timeout)
        # mode=auto writes the capture's, the calibration's and last the emulation's logs
        found = sorted(logs.rglob("stdout.log"), key=lambda f: f.stat().st_mtime)
        res["phases_ms"] = {str(f.relative_to(logs)): steady_ms(f.read_text()) for f in found}
        res["prism_emulated_ms"] = steady_ms(found[-1].read_text()) if found else None
        rep = work / "report" / "report.json"
        if rep.exists():
            pred = json.loads(rep.read_text())["predicted"]
            res["predicted_ms"] = pred["iteration_time_s"] * 1e3
            res["compute_source"] = pred.get("compute_source")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"one TP8 rank's layers of the 8B shape (8 layers x 8 micro-batches, seq 4096) at world 1: plain "
          f"torchrun {res.get('torchrun_ms')} ms per iteration; under prism-launch {res.get('prism_emulated_ms')} ms; "
          f"predicted {res.get('predicted_ms')} ms ({res.get('compute_source')}); each phase's log: "
          f"{res.get('phases_ms')}")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return report([Figure("plain torchrun ms per iteration", res.get("torchrun_ms"), None, ".1f"),
                   Figure("emulated ms per iteration (Megatron's own)", res.get("prism_emulated_ms"), None, ".1f"),
                   Figure("predicted ms per iteration", res.get("predicted_ms"), None, ".1f")])


if __name__ == "__main__":
    sys.exit(main())
