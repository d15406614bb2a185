"""Bad input gets a clear error, a non-zero exit, no hang, no orphan, no half-written trace."""

import json
import subprocess
import time

import pytest

from tests.conftest import EXAMPLES, WORKERS, run_prism

HANG = WORKERS / "hang.py"
COLL = WORKERS / "collectives.py"
BASE = ["--nproc-per-node", "2", "-r", "3", "device=cpu", "capture.warm_imports=[torch]"]


def _no_process_mentions(marker: str) -> bool:
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return not [l for l in out.splitlines() if marker in l and " Z" not in l and "ps -eo" not in l]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("errs")
    r = run_prism([*BASE, "mode=capture", f"trace.dir={d / 'tr'}", HANG], cwd=d)
    assert r.returncode == 0, r.stderr
    return d / "tr"


def test_sandbox_rank_out_of_range(tmp):
    r = run_prism([*BASE, "mode=emulate", "sandbox.ranks=[2]", HANG], cwd=tmp)
    assert r.returncode == 2
    assert "sandbox.ranks" in r.stderr and "out of range" in r.stderr and "0..1" in r.stderr


def test_bad_override_names_the_field(tmp):
    r = run_prism([*BASE, "target.world_size=lots", HANG], cwd=tmp)
    assert r.returncode == 2 and "target.world_size" in r.stderr


def test_missing_trace_says_how_to_make_one(tmp):
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={tmp / 'nothing'}", HANG], cwd=tmp)
    assert r.returncode == 1
    assert "mode=capture" in r.stderr and str(HANG) in r.stderr


def test_trace_from_other_args_is_refused(trace, tmp):
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={trace}", HANG, "--extra"], cwd=tmp)
    assert r.returncode == 1
    assert "different args" in r.stderr and "--extra" in r.stderr and "mode=capture" in r.stderr


def test_output_only_args_do_not_key_the_trace(tmp):
    """Megatron-LM's --save/--tensorboard-dir and a recipe's own flag named in trace.ignore_args
    may change between capture and emulation; a flag that changes the computation may not."""
    tr = tmp / "outs"
    own = ["trace.ignore_args=[--out]"]
    r = run_prism([*BASE, *own, "mode=capture", f"trace.dir={tr}", HANG, "--save", "ck1", "--tensorboard-dir=tb1",
                   "--out", "run1", "--hidden-size", "64"], cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_prism([*BASE, *own, "mode=emulate", f"trace.dir={tr}", HANG, "--save", "ck2", "--tensorboard-dir=tb2",
                   "--out", "run2", "--hidden-size", "64"], cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={tr}", HANG, "--save", "ck2", "--tensorboard-dir=tb2",
                   "--out", "run2", "--hidden-size", "64"], cwd=tmp)
    assert r.returncode == 1 and "--out" in r.stderr and "trace.ignore_args=[--out]" in r.stderr
    r = run_prism([*BASE, *own, "mode=emulate", f"trace.dir={tr}", HANG, "--save", "ck1", "--tensorboard-dir=tb1",
                   "--out", "run1", "--hidden-size", "128"], cwd=tmp)
    assert r.returncode == 1 and "different args" in r.stderr
    assert "script args differ: --hidden-size: recorded 64, now 128 (" in r.stderr
    assert "--save" not in r.stderr.split("trace.ignore_args")[0]  # neither named nor listed


def test_trace_from_other_world_is_refused(trace, tmp):
    r = run_prism([*BASE, "target.world_size=4", "mode=emulate", f"trace.dir={trace}", HANG], cwd=tmp)
    assert r.returncode == 1 and "different config" in r.stderr and "world_size" in r.stderr


def test_corrupted_trace_is_refused(trace, tmp):
    import shutil

    bad = tmp / "bad"
    shutil.copytree(trace, bad)
    tensors = sorted((bad / "tensors").iterdir())[0]
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={bad}", HANG], cwd=tmp)
    assert r.returncode == 1 and "checksum" in r.stderr.lower() and tensors.name in r.stderr


def test_crash_in_a_rank_stops_everything_and_leaves_no_trace(tmp):
    start = time.monotonic()
    r = run_prism([*BASE, "--nproc-per-node", "4", "--log-dir", tmp / "logs", "mode=capture",
                   f"trace.dir={tmp / 'tr'}", COLL], cwd=tmp, env={"FAIL_RANK": "2"}, timeout=120)
    assert r.returncode == 1
    assert "rank 2 failed" in r.stderr and "injected failure on rank 2" in r.stderr
    [run_dir] = list((tmp / "logs").iterdir())
    err = json.loads((run_dir / "2" / "error.json").read_text())
    assert "injected failure" in json.dumps(err)
    assert not (tmp / "tr").exists()
    assert not [p for p in tmp.iterdir() if ".partial" in p.name]
    assert _no_process_mentions(str(tmp))
    assert time.monotonic() - start < 90


def test_peer_that_never_arrives_hits_the_deadline_in_capture(tmp):
    start = time.monotonic()
    r = run_prism([*BASE, "comm.timeout_s=3", "mode=capture", f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp,
                  env={"HANG_RANK": "1"}, timeout=120)
    assert r.returncode == 1
    msg = r.stderr
    assert "allreduce (seq 1)" in msg and "ranks [0]" in msg and "ranks [1]" in msg and "never arrived" in msg
    assert time.monotonic() - start < 60
    assert not (tmp / "tr").exists()
    assert _no_process_mentions(str(tmp))


def test_sandbox_peer_that_never_arrives_hits_the_deadline_in_emulation(trace, tmp):
    start = time.monotonic()
    r = run_prism([*BASE, "comm.timeout_s=3", "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[0,1]",
                   f"report.dir={tmp / 'rep'}", HANG], cwd=tmp, env={"HANG_RANK": "1"}, timeout=120)
    assert r.returncode == 1
    assert "rank 0" in r.stderr and "allreduce" in r.stderr and "seq 1" in r.stderr
    assert time.monotonic() - start < 60
    assert _no_process_mentions(str(tmp))


@pytest.mark.parametrize("path", ["host", "device"])
def test_divergence_warns_by_default_and_fails_when_strict(trace, tmp, path):
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[1]", "emulate.timing=none",
                   f"emulate.data_path={path}", f"report.dir={tmp / 'rep'}", HANG], cwd=tmp, env={"SCALE": "2"})
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp / "rep" / "report.json").read_text())
    divs = report["ranks"]["1"]["divergences"]
    assert len(divs) == 3 and divs[0]["step"] == 0 and divs[0]["op"] == "allreduce"
    assert report["ranks"]["1"]["losses_match_capture"] is False
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[1]", "emulate.strict=true",
                   f"emulate.data_path={path}", f"report.dir={tmp / 'rep2'}", HANG], cwd=tmp, env={"SCALE": "2"})
    assert r.returncode == 1
    assert "divergence (value) on rank 1 at step 0: allreduce on group default_pg seq 0" in r.stderr


def test_megatron_world_not_divisible_surfaces_megatron_message(tmp):
    r = run_prism(["--nproc-per-node", "4", "-r", "3", "device=cpu", "mode=capture", f"trace.dir={tmp / 'tr'}",
                   EXAMPLES / "megatron_gpt.py", "--tensor-model-parallel-size", "3"], cwd=tmp, timeout=300)
    assert r.returncode == 1
    assert "failed" in r.stderr and "rank " in r.stderr
    assert "divisible" in r.stderr.lower()
    assert not (tmp / "tr").exists()


@pytest.mark.parametrize("path", ["host", "device"])
def test_sandbox_that_ends_early_is_reported(trace, tmp, path):
    start = time.monotonic()
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[1]", "emulate.timing=none",
                   f"emulate.data_path={path}", f"report.dir={tmp / 'rep'}", HANG], cwd=tmp, env={"STEPS": "1"},
                  timeout=120)
    assert r.returncode == 1
    if path == "host":  # the assistant holds data nobody took
        assert "sandbox rank 1 ended without taking the recorded data for op" in r.stderr
    else:  # the sandbox's own prefetcher holds ops never entered
        assert "sandbox rank 1 ended with" in r.stderr and "never entered" in r.stderr
    assert "diverged from the trace" in r.stderr
    assert time.monotonic() - start < 60


def test_sandboxes_that_end_before_a_pruned_ring_are_reported(tmp):
    """The assistant plays each group's recorded ring ops in order; when every sandbox rank has
    ended with one unplayed it fails, naming the group and seq, instead of waiting forever."""
    three = ["--nproc-per-node", "3", *BASE[2:]]
    r = run_prism([*three, "mode=capture", f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp)
    assert r.returncode == 0, r.stderr
    start = time.monotonic()
    r = run_prism([*three, "mode=emulate", f"trace.dir={tmp / 'tr'}", "sandbox.ranks=[0,2]", "emulate.timing=none",
                   "emulate.pruned_rings=true", "emulate.ring_tags=false", f"report.dir={tmp / 'rep'}", HANG],
                  cwd=tmp, env={"STEPS": "1"}, timeout=120)
    assert r.returncode == 1
    assert "not played to the end (group 0 at seq 1, all_reduce)" in r.stderr, r.stderr
    assert "diverged from the trace" in r.stderr
    assert time.monotonic() - start < 60
    assert _no_process_mentions(str(tmp))
