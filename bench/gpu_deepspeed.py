"""DeepSpeed on one GPU in a 1,024-rank logical world (run where CUDA is).

    source .mlm/activate.sh && python bench/gpu_deepspeed.py --out /tmp/gpu_ds

(the device call carries ``.whl``, ``.mlm`` — prepared by ``../shared/tools/gpu-stack.sh`` — and
``third_party/DeepSpeedExamples``, the ignored copy of the upstream script below.) Each part
fits one 10-minute device call when run alone:

    source .mlm/activate.sh && python bench/gpu_deepspeed.py --out /tmp/gpu_ds --recipes zero1,zero2,zero3 --no-upstream
    source .mlm/activate.sh && python bench/gpu_deepspeed.py --out /tmp/gpu_ds --recipes pipe,moe --no-upstream
    source .mlm/activate.sh && python bench/gpu_deepspeed.py --out /tmp/gpu_ds --recipes none

Part 1: the bundled recipes (``examples/deepspeed_*.py`` with ``examples/ds_configs/*.json``:
ZeRO-1, ZeRO-2, ZeRO-3, the pipeline engine, MoE) at ``--nnodes 128 --nproc-per-node 8``,
one sandbox rank (``--sandbox``, default 1023: ``LOCAL_RANK`` 7 on a machine with one GPU, so
the logical-to-physical device mapping is exercised; not rank 0, so ZeRO-3's consistency
broadcasts come from an uncaptured rank 0), ``device=cuda``: a folded capture, then the
emulation. Part 2: an unchanged DeepSpeedExamples training script that trains on generated
data (``training/bf16_master_weight/train.py``: ZeRO-3, bf16, random tokens) copied from
``third_party/DeepSpeedExamples`` (fetched, never committed; ``--upstream-dir``) at
``--upstream-world`` logical ranks (default 64), with ``examples/ds_configs/dse_zero3_bf16.json``
(its own baseline config plus ``"torch_adam": true``: the GPU image's DeepSpeed is built without
ops). The script takes ``torch.cuda.set_device(local_rank)`` and
``get_accelerator().device_name(local_rank)`` with ``local_rank`` = the logical global rank.

Checks, each a failure (exit 1) when it does not hold: both runs exit 0; the sandbox's logged
losses (and, for the bundled recipes, grad norms and parameter checksums) equal the capture's
exactly; the report says ``losses_match_capture`` and lists no divergence; the capture time,
emulation time, sandbox GPU peak, predicted iteration time and the sandbox's DeepSpeed memory
breakdown (ZeRO partitions, buckets, live parameters, optimizer state by device) are all
present; the OOM verdict at the target's limit (``oom_ranks``) is printed with them. Prints one
JSON line per job and writes ``summary.json`` under ``--out``; an existing trace there is
reused (``--fresh`` re-captures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from deepspeed_fidelity import EX, RECIPES  # noqa: E402 - the bundled recipes, one table for both benches
UPSTREAM = Path("training/bf16_master_weight/train.py")
UPSTREAM_ARGS = ["--hidden_dim", "512", "--num_layers", "4", "--num_heads", "8", "--vocab_size", "8192",
                 "--batch_size", "2", "--seq_length", "256", "--num_steps", "6", "--warmup_steps", "1",
                 "--log_interval", "1"]
_METRIC = re.compile(r"\b(loss|grad_norm|param_checksum)[ =](\S+)")


def metrics(log_dir: Path, rank: int) -> list[dict]:
    """The rank's logged numbers, line by line (exact strings: equality is bit-identity as printed)."""
    out = []
    for path in sorted(log_dir.glob(f"*/{rank}/stdout.log")):
        for line in path.read_text(errors="replace").splitlines():
            found = dict(_METRIC.findall(line))
            if "loss" in found:
                out.append(found)
    return out


def launch(args: list, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=3600)
    dt = time.monotonic() - t0
    print(f"  [{dt:.0f}s] prism-launch {' '.join(map(str, args[:10]))} ... -> {r.returncode}", flush=True)
    if r.returncode != 0:
        print(r.stderr[-5000:], flush=True)
    return dt, r


def job(name: str, world: int, sandbox: int, script: list, work: Path, fresh: bool) -> dict:
    """Folded capture, then emulation of ``sandbox``; the figures and the failed checks."""
    out = work / name
    flags = ["--nnodes", world // 8, "--nproc-per-node", 8, "-r", "3", "device=cuda", f"sandbox.ranks=[{sandbox}]",
             f"trace.dir={out / 'trace'}", "comm.timeout_s=900", "capture.fold=true"]
    res: dict = {"job": name, "world": world, "sandbox": sandbox, "failures": []}
    fail = res["failures"].append
    reuse = not fresh and (out / "trace" / "manifest.json").exists() and metrics(out / "cap", sandbox)
    if reuse:
        res["capture_s"] = json.loads((out / "capture_s.json").read_text()) if (out / "capture_s.json").exists() else None
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        dt, r = launch([*flags, "--log-dir", out / "cap", "mode=capture", *script], out)
        if r.returncode != 0:
            fail(f"capture exited {r.returncode}")
            return res
        res["capture_s"] = round(dt, 1)
        (out / "capture_s.json").write_text(json.dumps(res["capture_s"]))
        m = re.search(r"captured .*? in [\d.]+s", r.stderr)
        res["capture"] = m.group(0) if m else None
    for stale in (out / "emu", out / "rep"):
        shutil.rmtree(stale, ignore_errors=True)
    dt, r = launch([*flags, "--log-dir", out / "emu", "mode=emulate", f"report.dir={out / 'rep'}", *script], out)
    if r.returncode != 0:
        fail(f"emulation exited {r.returncode}")
        return res
    res["emulate_s"] = round(dt, 1)
    cap, emu = metrics(out / "cap", sandbox), metrics(out / "emu", sandbox)
    res["steps"] = len(emu)
    res["logged_bit_identical"] = bool(cap) and cap == emu
    if not res["logged_bit_identical"]:
        fail(f"logged numbers differ from the capture's (capture {cap[:3]}, emulation {emu[:3]})")
    rep_path = out / "rep" / "report.json"
    if not rep_path.exists():
        fail("no report.json")
        return res
    rep = json.loads(rep_path.read_text())
    me = rep.get("ranks", {}).get(str(sandbox), {})
    res["losses_match_capture"] = me.get("losses_match_capture")
    if me.get("losses_match_capture") is not True:
        fail(f"report: losses_match_capture={me.get('losses_match_capture')!r}")
    res["divergences"] = len(me.get("divergences") or [])
    if res["divergences"]:
        fail(f"{res['divergences']} divergences, first {me['divergences'][0]}")
    peak = me.get("peak_memory_bytes")
    res["sandbox_peak_gib"] = None if peak is None else round(peak / 2**30, 4)
    predicted = rep.get("predicted", {})
    it = predicted.get("iteration_time_s")
    res["predicted_iteration_ms"] = None if it is None else round(it * 1e3, 2)
    res["oom_ranks"] = predicted.get("oom_ranks")
    res["virtual_ranks"] = rep.get("virtual_ranks")
    for path in sorted((out / "emu").glob(f"*/{sandbox}/stdout.log")):  # integrations/deepspeed_compat.py
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(f"prism-launch: deepspeed memory rank {sandbox} "):
                res["deepspeed_memory"] = json.loads(line.split(" ", 5)[5])
    if "deepspeed_memory" not in res:
        fail("no 'prism-launch: deepspeed memory' line in the sandbox's log")
    for key in ("capture_s", "emulate_s", "sandbox_peak_gib", "predicted_iteration_ms"):
        if res.get(key) is None:
            fail(f"missing {key}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_deepspeed"))
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, or 'none'")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--sandbox", type=int, default=None, help="default: the world's last rank")
    ap.add_argument("--no-upstream", action="store_true", help="skip part 2 (the DeepSpeedExamples script)")
    ap.add_argument("--upstream-dir", type=Path, default=ROOT / "third_party" / "DeepSpeedExamples")
    ap.add_argument("--upstream-world", type=int, default=64)
    ap.add_argument("--fresh", action="store_true", help="re-capture even when a trace is in --out")
    a = ap.parse_args()
    try:
        import torch

        if not torch.cuda.is_available():
            print("gpu_deepspeed: no CUDA device here", file=sys.stderr)
            return 1
        print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", flush=True)
        import deepspeed

        print(f"deepspeed {deepspeed.__version__}", flush=True)
    except ImportError as e:
        print(f"gpu_deepspeed: {e}", file=sys.stderr)
        return 1
    work = a.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    names = [] if a.recipes == "none" else a.recipes.split(",")
    for name in names:
        if name not in RECIPES:
            print(f"gpu_deepspeed: unknown recipe {name!r} (known: {', '.join(RECIPES)})", file=sys.stderr)
            return 1
        recipe, conf = RECIPES[name]
        script = [EX / recipe, "--deepspeed", "--deepspeed_config", EX / "ds_configs" / conf, "--log-all-ranks"]
        sandbox = a.world - 1 if a.sandbox is None else a.sandbox
        rows.append(job(name, a.world, sandbox, script, work, a.fresh))
        print(json.dumps(rows[-1]), flush=True)
    if not a.no_upstream:
        src = a.upstream_dir / UPSTREAM
        if not src.exists():
            rows.append({"job": "upstream", "failures": [f"{src} not found: fetch deepspeedai/DeepSpeedExamples "
                                                         f"into {a.upstream_dir} (and carry it)"]})
        else:
            copy = work / "upstream_src" / "train.py"  # the unchanged script, copied at run time
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, copy)
            script = [copy, "--deepspeed_config", EX / "ds_configs" / "dse_zero3_bf16.json", *UPSTREAM_ARGS]
            sandbox = a.upstream_world - 27 if a.sandbox is None else a.sandbox  # LOCAL_RANK 5 of node n-4
            row = job("upstream_bf16_master_weight", a.upstream_world, sandbox, script, work, a.fresh)
            row["script"] = f"DeepSpeedExamples/{UPSTREAM}"
            rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    (work / "summary.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'job':30} {'world':>6} {'capture s':>10} {'emulate s':>10} {'peak GiB':>9} {'pred ms':>9}  bit-identical")
    for r in rows:
        cell = (lambda k: "MISSING" if r.get(k) is None else r[k])  # noqa: E731 - a 0 is a value, not a gap
        print(f"{r['job']:30} {r.get('world', ''):>6} {cell('capture_s'):>10} {cell('emulate_s'):>10} "
              f"{cell('sandbox_peak_gib'):>9} {cell('predicted_iteration_ms'):>9}  "
              f"{'yes' if r.get('logged_bit_identical') and r.get('losses_match_capture') else 'NO'}")
    failed = [(r["job"], f) for r in rows for f in r.get("failures", [])]
    for j, f in failed:
        print(f"FAILED {j}: {f}", file=sys.stderr)
    if not rows:
        print("gpu_deepspeed: nothing was run", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
