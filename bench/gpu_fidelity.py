"""GPU fidelity harness: upstream Megatron-LM ``pretrain_gpt.py`` (unchanged) on one GPU, real
against predicted, interleaved and repeated. Run on the H200 from the repository root:

    source .mlm/activate.sh
    python bench/gpu_fidelity.py --pairs 3 --iters 20 --cluster h200_ib --out gpu_fidelity.json

(``--cases`` picks cases, default a 1.6B-parameter model's dense and MoE (EP1) jobs at two
sequence lengths and micro-batch counts, whose step is the GPU's; the 84M model's cases —
``dense-s1024-m1`` and the like — are the host's step on the H200; ``--dp 8`` sizes the
data-parallel prediction; ``--budget-s`` keeps the whole run inside one device command: no pair
starts that would end past it, and the rows so far are written to ``--out`` after every pair.)
For each case it records the job once (``mode=capture``, world 1, ``capture.payload=none``)
and runs ``--pairs`` pairs, alternating which run goes first, of

* ``real``: ``prism-launch --nproc-per-node 1 mode=real device=cuda pretrain_gpt.py ...``:
  Megatron's ``elapsed time per iteration (ms)`` (median of the iterations after the first)
  and the rank's allocator-level peak (``memory.json``);
* ``predicted``: ``mode=calibrate`` on that trace into a fresh calibrated version (rank 0 runs
  alone on the GPU, its compute spans measured), then the global replay the report runs
  (``prism_launch.predict.prediction.predict``) on ``--cluster``: the predicted iteration time
  (compute only: no peer) and rank 0's predicted peak, a virtual rank's (from the capture);
  beside it the calibrating run's own Megatron step, which tells a span that missed time from
  a calibrating run slower than the job;

and for ``--dp-cases`` the same job as rank 0 of a ``--dp``-way data-parallel world (global
batch scaled by ``--dp``; the other ranks virtual), whose prediction adds the cost model's
gradient all-reduce on ``--cluster`` — printed beside the world-1 prediction, with no real run
to compare (one GPU).

It prints the machine (GPU, host, cores), the cluster and the calibration method the report
states; then per case mean/spread/max of the iteration-time error and the largest peak-memory
error. Goals (exit code 1 when missed, or when a value is missing or not finite): world-1
iteration time within 2% mean, peak memory within 0.1%; the data-parallel prediction no
faster than the world-1 one.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_stats import Pair, failures, load, machine, summarize, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from upstream import pretrain_gpt  # noqa: E402

BASE = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--max-position-embeddings",
        "1024", "--bf16", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192",
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "1"]
# no linear biases: with one tensor-parallel rank megatron-core returns the expert output from its
# tensor-parallel reduction as is, and the bias add on it in place is refused by autograd (as
# under torchrun: "Output 0 of _ReduceFromModelParallelRegionBackward is a view ...")
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "1", "--disable-bias-linear"]
MICRO_BATCH = 2
# a 1.6B-parameter GPT (8 layers, hidden 4096) whose step is the GPU's: the 84M model's step on
# the H200 is the host's (Python launching ~3 ms of kernels in ~30 ms), so it moves with the host's
# speed from one run to the next (22 to 34 ms medians of the same job); MoE experts get FFN 4096
# (4 experts, top 2) to stay the same size


def _replaced(flags: list[str], values: dict[str, str]) -> list[str]:
    """``flags`` with the values of the options in ``values`` replaced."""
    out = list(flags)
    for opt, v in values.items():
        out[out.index(opt) + 1] = v
    return out


BIG = _replaced(BASE, {"--num-layers": "8", "--hidden-size": "4096", "--num-attention-heads": "32",
                       "--max-position-embeddings": "2048"})
DEFAULT_CASES = ("1.6b-dense-s2048-m1", "1.6b-moe-s2048-m1", "1.6b-dense-s1024-m2")
CAPTURE_PAYLOAD = "none"
"""World 1 has no peer whose data a sandbox reads: the capture keeps no tensor and copies none to the host."""
MODELS = {"84m": (BASE, MICRO_BATCH, []), "1.6b": (BIG, 4, ["--ffn-hidden-size", "4096"])}
"""model: (flags, micro-batch size, extra flags of its MoE case)."""
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def cases() -> dict[str, dict]:
    """Every case by name: ``[1.6b-]<dense|moe>-s<seq>-m<micro-batches per step>`` (no prefix:
    the 84M model)."""
    out = {}
    for model, seqs in (("84m", (512, 1024)), ("1.6b", (1024, 2048))):
        for kind in ("dense", "moe"):
            for seq in seqs:
                for micro in (1, 2, 4):
                    name = f"{kind}-s{seq}-m{micro}" if model == "84m" else f"{model}-{kind}-s{seq}-m{micro}"
                    out[name] = {"model": model, "kind": kind, "seq": seq, "micro": micro}
    return out


def job_args(case: dict, iters: int, dp: int = 1) -> list[str]:
    """``pretrain_gpt.py``'s arguments for ``case`` as a ``dp``-way data-parallel job."""
    flags, mbs, moe_extra = MODELS[case.get("model", "84m")]
    return [*flags, *([*MOE, *moe_extra] if case["kind"] == "moe" else []), "--seq-length", str(case["seq"]),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs * case["micro"] * dp),
            "--train-iters", str(iters)]


def iteration_s(text: str) -> float:
    """Median of Megatron's per-iteration times after the first iteration (s)."""
    times = [float(m.group(2)) for m in _ITER.finditer(text) if int(m.group(1)) > 1]
    if not times:
        raise ValueError("no 'elapsed time per iteration (ms)' line after iteration 1")
    return statistics.median(times) / 1e3


def _prism(args: list, cwd: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"failed: prism-launch {' '.join(map(str, args[:10]))} ...\n{r.stderr[-4000:]}")


def real(script: Path, job: list, work: Path) -> tuple[float, dict[int, int]]:
    _prism(["--nproc-per-node", "1", "--log-dir", work, "mode=real", "device=cuda", script, *job], work.parent)
    text = "".join(p.read_text() for p in work.glob("*/0/stdout.log"))
    mem = list(work.glob("*/0/memory.json"))
    if len(mem) != 1:
        raise SystemExit(f"real run under {work}: expected one memory.json for rank 0, found {len(mem)}")
    return iteration_s(text), {0: json.loads(mem[0].read_text())["peak_bytes"]}


def capture(script: Path, job: list, trace: Path, nproc: int = 1) -> None:
    """The case's trace, recorded once: every pair calibrates it again (the measurement a
    prediction's compute comes from), so a pair costs a real run and a calibration."""
    _prism(["--nproc-per-node", str(nproc), "--log-dir", trace.parent / "capture-logs", "mode=capture",
            "device=cuda", f"trace.dir={trace}", "sandbox.ranks=[0]", f"capture.payload={CAPTURE_PAYLOAD}",
            *(["capture.fold=true"] if nproc > 1 else []), script, *job], trace.parent)


def calibrated_prediction(script: Path, job: list, trace: Path, cluster: str, nproc: int = 1, logs: Path | None = None) -> dict:
    """``mode=calibrate`` (one rank per GPU) into a fresh ``<trace>/calibrated``, then the global
    replay the report runs (:func:`prism_launch.predict.prediction.predict`) on ``cluster``:
    predicted iteration time, and rank 0's predicted peak — a virtual rank's, from the capture."""
    shutil.rmtree(trace / "calibrated", ignore_errors=True)
    logs = logs or trace.parent / "calibrate-logs"
    _prism(["--nproc-per-node", str(nproc), "--log-dir", logs, "mode=calibrate",
            "device=cuda", f"trace.dir={trace}", "sandbox.ranks=[0]", script, *job], trace.parent)
    from prism_launch.config.root import compose, resolve
    from prism_launch.predict.prediction import predict
    from prism_launch.trace import TraceLayout, TraceReader

    cfg = resolve(compose(["device=cuda", f"cluster={cluster}", f"trace.dir={trace}"]))
    bare = TraceReader(trace)
    memory = {int(r): m["peak_bytes"] for r, m in bare.read_json(TraceLayout.MEMORY).items()
              if m.get("peak_bytes") is not None}
    out = predict(cfg, bare, TraceLayout(trace), [0], memory)
    out.pop("replay", None)
    # the calibrating run's own step (Megatron's log): where the prediction and the real run part
    text = "".join(p.read_text() for p in sorted(logs.rglob("stdout.log")))
    try:
        out["calibrating_run_step_s"] = iteration_s(text)
    except ValueError:
        out["calibrating_run_step_s"] = None
    return out


SEEN: dict[str, list[float]] = {"capture": [], "pair": []}
"""Seconds the captures and pairs so far took: a case starts only when its capture and one pair fit."""


def run_case(name: str, script: Path, pairs: int, iters: int, cluster: str, dp: int, keep: bool,
             deadline: float, record) -> dict | None:
    case = cases()[name]
    work = Path(tempfile.mkdtemp(prefix=f"prism-gpu-fidelity-{name}-"))
    job, out, method, took, cal_runs = job_args(case, iters), [], None, [], []
    trace = work / "trace"
    try:
        t0 = time.monotonic()
        capture(script, job, trace)
        SEEN["capture"].append(time.monotonic() - t0)
        print(f"  {name}: captured in {time.monotonic() - t0:.0f}s", flush=True)
        for i in range(pairs):
            if took and time.monotonic() + max(took) > deadline:
                print(f"  {name}: stopping after {i} pair(s): the next would pass --budget-s", flush=True)
                break
            t1 = time.monotonic()

            def pred(i=i):
                rep = calibrated_prediction(script, job, trace, cluster, logs=work / f"calibrate{i}")
                peaks = {int(r): v["peak_memory_bytes"] for r, v in rep["ranks"].items() if v.get("peak_memory_bytes")}
                cal_runs.append(rep["calibrating_run_step_s"])
                return rep["predicted"]["iteration_time_s"], peaks, rep["predicted"]

            runs = [("real", lambda i=i: real(script, job, work / f"real{i}")), ("pred", pred)]
            done = {n: fn() for n, fn in (runs if i % 2 == 0 else runs[::-1])}
            method = method or _method(done["pred"][2])
            out.append(Pair(done["real"][0], done["pred"][0], done["real"][1], done["pred"][1]))
            took.append(time.monotonic() - t1)
            SEEN["pair"].append(took[-1])
            print(f"  {name} pair {i + 1}/{pairs} ({'real first' if i % 2 == 0 else 'prediction first'}, "
                  f"{took[-1]:.0f}s): real {out[-1].real_step_s * 1e3:.2f} ms, predicted "
                  f"{out[-1].predicted_step_s * 1e3:.2f} ms ({out[-1].time_error_pct:+.2f}%; the calibrating run's own step "
                  f"{_ms(cal_runs[-1])}), memory "
                  f"{out[-1].memory_error_pct:.4f}%; {load()}", flush=True)
            record(name, out)
        dp_s = None
        if dp > 1 and time.monotonic() + 3 * max(took or [60]) < deadline:
            dp_trace = work / "dp" / "trace"
            dp_trace.parent.mkdir()
            capture(script, job_args(case, iters, dp), dp_trace, nproc=dp)
            dp_s = calibrated_prediction(script, job_args(case, iters, dp), dp_trace, cluster, nproc=dp)[
                "predicted"]["iteration_time_s"]
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    if not out:
        return None
    return summarize(name, out, time_goal_pct=2.0, memory_goal_pct=0.1, calibration=method,
                     dp_world=dp if dp_s is not None else None, dp_predicted_ms=None if dp_s is None else dp_s * 1e3)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def _method(pred: dict) -> str:
    cal = pred.get("calibration") or {}
    return f"{pred.get('compute_source')}: {cal.get('slices')} slice(s), {cal.get('method')}"


def dp_failures(rows: list[dict]) -> list[str]:
    """The data-parallel prediction adds gradient communication: never below the world-1 one."""
    return [f"{r['case']}: DP{r['dp_world']} prediction {r['dp_predicted_ms']:.2f} ms below world 1's "
            f"{r['predicted_ms']:.2f} ms" for r in rows
            if r.get("dp_world") and not (r.get("dp_predicted_ms") is not None
                                          and r["dp_predicted_ms"] >= r["predicted_ms"] * 0.999)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--cluster", default="h200_ib")
    ap.add_argument("--dp", type=int, default=8, help="data-parallel world of the extra prediction (0: none)")
    ap.add_argument("--dp-cases", default=None, help="cases that also get the data-parallel prediction (default: the first)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no pair (or data-parallel prediction) that would end past this many seconds")
    ap.add_argument("--mlm", default=str(ROOT / ".mlm"))
    ap.add_argument("--keep", action="store_true", help="keep the work directories")
    ap.add_argument("--out")
    a = ap.parse_args()
    script = pretrain_gpt(a.mlm)
    if script is None:
        return 2
    names = a.cases.split(",")
    dp_cases = set(a.dp_cases.split(",") if a.dp_cases else names[:1])
    deadline = time.monotonic() + (a.budget_s if a.budget_s else 1e9)
    print(f"machine: {machine()}; {load()}\ncluster: {a.cluster}; real: mode=real; predicted: mode=capture once per "
          f"case, then per pair mode=calibrate (one rank per GPU) and the global replay; world 1"
          + (f" and DP{a.dp}" if a.dp > 1 else ""), flush=True)
    partial: dict[str, list[Pair]] = {}

    def record(name: str, pairs: list[Pair]) -> None:
        partial[name] = list(pairs)
        if a.out:
            rows = [summarize(n, ps, time_goal_pct=2.0, memory_goal_pct=0.1) for n, ps in partial.items()]
            Path(a.out).write_text(json.dumps({"machine": machine(), "cluster": a.cluster, "partial": True,
                                               "rows": rows}, indent=1))

    rows = []
    for n in names:
        need = max(SEEN["capture"] or [0.0]) + max(SEEN["pair"] or [0.0])
        if rows and time.monotonic() + need > deadline:
            print(f"  {n}: not run (--budget-s)", flush=True)
            continue
        row = run_case(n, script, a.pairs, a.iters, a.cluster, a.dp if n in dp_cases else 0, a.keep, deadline, record)
        if row is not None:
            rows.append(row)
    print(f"\nmachine: {machine()}; cluster {a.cluster}; calibration {rows[0]['calibration'] if rows else '-'}")
    print(table(rows))
    for r in rows:
        if r.get("dp_world"):
            print(f"{r['case']:34} DP{r['dp_world']} predicted {r['dp_predicted_ms']:.2f} ms "
                  f"(world 1 {r['predicted_ms']:.2f} ms): gradients add {r['dp_predicted_ms'] - r['predicted_ms']:.2f} ms")
    if a.out:
        Path(a.out).write_text(json.dumps({"machine": machine(), "cluster": a.cluster, "rows": rows}, indent=1))
    bad = failures(rows) + dp_failures(rows)
    for b in bad:
        print(f"FAIL: {b}", file=sys.stderr)
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
