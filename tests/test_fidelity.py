"""Calibration and predictions end to end on the bundled recipe (2 ranks, CPU)."""

import json

import pytest

from tests.conftest import EXAMPLES, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
ARGS = ["--tensor-model-parallel-size", "2", "--train-iters", "3"]
FLAGS = ["--nproc-per-node", "2", "-r", "3", "device=cpu", "comm.timeout_s=120"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    d = tmp_path_factory.mktemp("fid")
    trace = d / "trace"
    r = run_prism([*FLAGS, "mode=capture", f"trace.dir={trace}", RECIPE, *ARGS], cwd=d, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_prism([*FLAGS, "mode=calibrate", "calibrate.slice_size=1", f"trace.dir={trace}", RECIPE, *ARGS],
                  cwd=d, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, trace


def test_calibration_writes_a_new_trace_version(calibrated):
    _d, trace = calibrated
    bare = json.loads((trace / "manifest.json").read_text())
    cal = json.loads((trace / "calibrated" / "manifest.json").read_text())
    assert cal["fingerprint"] == bare["fingerprint"]
    # TP peers of one stage are one shard class: one slice per measurement (one rank per slice
    # here), distinct members first, the class's median given to both
    assert cal["extra"]["slices"] == [[0], [1], [0]]
    assert cal["extra"]["by_class"] is True and cal["extra"]["repeats"] == 3
    assert [(c["members"], c["measurements"]) for c in cal["extra"]["shard_classes"]] == [(2, 3)]
    assert cal["extra"]["ranks_mismatched"] == []
    assert (cal["extra"]["ranks_per_slice"], cal["extra"]["method"]) == (1, "one rank per CPU core")
    import pyarrow.parquet as pq

    events = pq.read_table(trace / "events.parquet")
    assert cal["extra"]["events_calibrated"] == events.num_rows
    calibrated_rows = pq.read_table(trace / "calibrated" / "events.parquet").to_pylist()
    assert all("bare_wall_s" in json.loads(r["extra"]) for r in calibrated_rows)
    # the bare graph is kept as it was captured
    assert "calibrated_from" not in bare["extra"]
    import hashlib

    assert hashlib.sha256((trace / "events.parquet").read_bytes()).hexdigest() == bare["files"]["events.parquet"]


def test_slices_never_take_more_ranks_than_devices(calibrated, tmp_path):
    """A slice asked to hold more ranks than there are devices (cores here) is cut to one rank
    per device, and says so: two ranks sharing a device inflate each other's spans."""
    import os

    d, trace = calibrated
    copy = tmp_path / "trace"
    import shutil

    shutil.copytree(trace, copy, ignore=shutil.ignore_patterns("calibrated", "report"))
    cores = len(os.sched_getaffinity(0))
    r = run_prism([*FLAGS, "mode=calibrate", f"calibrate.slice_size={cores + 6}", f"trace.dir={copy}", RECIPE, *ARGS],
                  cwd=d, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"calibrate.slice_size={cores + 6} but this machine has {cores} CPU core(s)" in r.stderr
    extra = json.loads((copy / "calibrated" / "manifest.json").read_text())["extra"]
    assert extra["ranks_per_slice"] == cores
    assert all(len(s) <= cores for s in extra["slices"]) and extra["devices"] == cores


def test_emulation_report_has_predictions_timeline_and_plots(calibrated):
    d, trace = calibrated
    r = run_prism([*FLAGS, "mode=emulate", "cluster=h100_ib", "sandbox.ranks=[1]", f"trace.dir={trace}",
                   "replay.compute=calibrated",
                   RECIPE, *ARGS], cwd=d, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shown = " ".join(r.stderr.split())  # the terminal table wraps long lines
    assert "predicted on h100_ib (calibrated: 3 slices, one rank per CPU core compute spans)" in shown
    assert "compute spans: calibrated (1 shard class(es), each measured 3 time(s) and given the per-event median" in shown
    rep = json.loads((trace / "report" / "report.json").read_text())
    pred = rep["predicted"]
    assert pred["compute_source"] == "calibrated" and pred["cluster"] == "h100_ib"
    assert pred["calibration"]["method"] == "one rank per CPU core" and pred["calibration"]["slices"] == 3
    assert pred["calibration"]["shard_classes"] == 1 and pred["compute_source"] == "calibrated"
    assert pred["iteration_time_s"] > 0 and len(pred["iteration_times_s"]) == 3
    assert pred["oom_ranks"] == []
    assert set(rep["ranks"]) == {"0", "1"}
    assert rep["ranks"]["1"]["sandbox"] is True and rep["ranks"]["0"]["sandbox"] is False
    assert all(rep["ranks"][r]["iteration_time_s"] > 0 for r in ("0", "1"))
    timeline = json.loads((trace / "report" / "timeline.json").read_text())
    tids = {e["tid"] for e in timeline["traceEvents"] if e["ph"] == "X"}
    assert tids == {0, 1}
    for png in ("step_time_per_rank.png", "pipeline_timeline.png"):
        assert (trace / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sandbox_ooms_where_the_target_would(calibrated, tmp_path):
    """A target GPU too small for the job: the virtual ranks are predicted to OOM (capture peaks)
    and the sandbox's capped allocator really raises; the report is written and the run fails
    with what happened."""
    d, trace = calibrated
    limit_gib = 0.0005  # ~0.5 MiB: below every rank's peak
    r = run_prism([*FLAGS, "mode=emulate", "sandbox.ranks=[1]", "memory.enforce_limit=true",
                   f"cluster.gpu_memory_gib={limit_gib}", f"trace.dir={trace}", f"report.dir={tmp_path / 'rep'}",
                   RECIPE, *ARGS], cwd=d, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "ran out of memory at the target's limit" in r.stderr and "OutOfMemoryError" in r.stderr
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["predicted"]["oom_ranks"] == [0, 1]  # the virtual rank by its capture peak, the sandbox for real
    assert rep["sandbox_oom"]["rank"] == 1 and rep["ranks"]["1"]["oom"] is True
    assert rep["sandbox_oom"]["message"].startswith("rank 1: OutOfMemoryError")
    assert rep["sandbox_oom"]["limit_bytes"] == int(limit_gib * 2**30)
