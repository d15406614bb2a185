"""Capture at scale on CPU: context-switched capture (``capture.slots``) changes nothing in
the results; folded capture runs only the closed set of representative ranks, equals the full
capture when data-parallel replicas see the same data, and replays bit-identically."""

from __future__ import annotations

import json
import shutil

import pytest
import re

from tests.conftest import EXAMPLES, WORKERS, rank_lines, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
DENSE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--replicate-data",
         "--log-all-ranks"]
BASE = ["--nnodes", "2", "--nproc-per-node", "8", "-r", "3", "device=cpu", "comm.timeout_s=120"]
_NUM = re.compile(r"(loss|grad_norm|param_checksum) (\S+)")


def _values(log_dir, rank: int) -> list[tuple]:
    """Every logged number of a rank, as strings (bitwise comparison), in order."""
    return [tuple(_NUM.findall(line)) for line in rank_lines(log_dir, rank) if _NUM.search(line)]


def test_folded_capture_equals_full_capture_and_replays_exactly(tmp_path):
    sandbox = 10
    full = run_prism([*BASE, "--log-dir", tmp_path / "full", "mode=capture", "capture.fold=false", "capture.slots=1",
                      f"trace.dir={tmp_path / 'tfull'}", RECIPE, *DENSE], cwd=tmp_path, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    folded = run_prism([*BASE, "--log-dir", tmp_path / "fold", "mode=capture", "capture.fold=true",
                        f"sandbox.ranks=[{sandbox}]", f"trace.dir={tmp_path / 'tfold'}", RECIPE, *DENSE],
                       cwd=tmp_path, timeout=600)
    assert folded.returncode == 0, folded.stderr[-3000:]
    assert "captured 4 of 16 logical ranks (folded)" in folded.stderr
    assert json.loads((tmp_path / "tfold" / "manifest.json").read_text())["ranks_captured"] == [2, 3, 10, 11]
    stats = json.loads((tmp_path / "tfull" / "capture.json").read_text())
    assert stats["slots"] == 1 and stats["max_running"] == 1 and stats["resumes"] > 16
    # replicas see the same data: stand-in contributions are the real ones, bit for bit
    for rank in (2, 3, 10, 11):
        a, b = _values(tmp_path / "full", rank), _values(tmp_path / "fold", rank)
        assert len(a) >= 3 and a == b, rank
    emu = run_prism([*BASE, "--log-dir", tmp_path / "emu", "mode=emulate", f"sandbox.ranks=[{sandbox}]",
                     f"trace.dir={tmp_path / 'tfold'}", RECIPE, *DENSE], cwd=tmp_path, timeout=600)
    assert emu.returncode == 0, emu.stderr[-3000:]
    assert _values(tmp_path / "emu", sandbox) == _values(tmp_path / "fold", sandbox)
    report = json.loads((tmp_path / "tfold" / "report" / "report.json").read_text())
    assert report["fold"]["captured_ranks"] == 4 and "approximated" in report["fold"]
    assert len(report["ranks"]) == 16 and report["ranks"]["14"]["mirrors"] == 10
    assert report["ranks"][str(sandbox)]["sandbox"] is True
    assert report["predicted"]["ranks_replayed"] == 4
    summary = json.loads((tmp_path / "tfold" / "report" / "sandbox" / f"rank{sandbox}.json").read_text())
    assert summary["folded_ops"] > 0 and summary["divergences"] == []
    # the virtual side's time on the program's thread is measured, and is a part of the run
    assert 0 < summary["own_s"] < summary["steps"][-1]["t"]
    # every thread the rank started for its ops ended with the rank (none left to finalization)
    assert summary["helper_threads"] > 0 and summary["in_flight_at_close"] == []
    # a sandbox rank outside the captured set is refused with what to do
    out = run_prism([*BASE, "mode=emulate", "sandbox.ranks=[5]", f"trace.dir={tmp_path / 'tfold'}", RECIPE, *DENSE],
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 1 and "not in the trace" in out.stderr and "mode=auto" in out.stderr


def test_context_switching_changes_no_result(tmp_path):
    common = ["--nproc-per-node", "8", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60"]
    runs = {}
    for slots in (1, 0):
        d = tmp_path / f"s{slots}"
        r = run_prism([*common, "--log-dir", d, "mode=capture", f"capture.slots={slots}", f"trace.dir={tmp_path / f't{slots}'}",
                       WORKERS / "collectives.py"], cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[slots] = d
    assert json.loads((tmp_path / "t1" / "capture.json").read_text())["max_running"] == 1
    assert json.loads((tmp_path / "t0" / "capture.json").read_text())["max_running"] == 8
    for rank in range(8):
        a = rank_lines(runs[1], rank, f"R{rank} ")
        b = rank_lines(runs[0], rank, f"R{rank} ")
        assert a and a == b, rank


def test_sandboxes_on_two_physical_nodes(tmp_path):
    """Two prism-launch processes, one per physical "node", share sandbox ranks [0, 3] through
    node 0's c10d store; results are bit-identical to the capture, node 0 writes the report."""
    import socket
    import subprocess
    import sys

    from tests.conftest import _env

    common = ["--nproc-per-node", "4", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60"]
    script = WORKERS / "collectives.py"
    trace = tmp_path / "trace"
    r = run_prism([*common, "--log-dir", tmp_path / "cap", "mode=capture", f"trace.dir={trace}", script], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "prism_launch", *common, "--log-dir", str(tmp_path / f"node{node}"),
               "mode=emulate", "sandbox.ranks=[0,3]", f"trace.dir={trace}", "physical.nodes=2",
               f"physical.node_rank={node}", f"physical.endpoint=127.0.0.1:{port}", str(script)]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_o, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert rank_lines(tmp_path / "node0", 0, "R0 ") == rank_lines(tmp_path / "cap", 0, "R0 ")
    assert rank_lines(tmp_path / "node1", 3, "R3 ") == rank_lines(tmp_path / "cap", 3, "R3 ")
    assert not list((tmp_path / "node0").glob("*/3")) and not list((tmp_path / "node1").glob("*/0"))
    report = json.loads((trace / "report" / "report.json").read_text())
    assert report["ranks"]["0"]["sandbox"] and report["ranks"]["3"]["sandbox"]
    assert report["ranks"]["3"]["divergences"] == [] and report["ranks"]["3"]["ops"] > 0
    assert "report is written by node 0" in outs[1][1]


def test_folded_broadcast_from_an_uncaptured_root(tmp_path):
    """Only rank 3 is captured (no model-parallel groups); rank 0's broadcast takes the data rank 3
    itself holds (its stand-in's buffer), and the emulation of rank 3 replays it exactly."""
    common = ["--nproc-per-node", "8", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60",
              "capture.fold=true", "sandbox.ranks=[3]", f"trace.dir={tmp_path / 't'}"]
    script = WORKERS / "broadcast_root.py"
    cap = run_prism([*common, "--log-dir", tmp_path / "cap", "mode=capture", script], cwd=tmp_path)
    assert cap.returncode == 0, cap.stderr[-3000:]
    assert "captured 1 of 8 logical ranks (folded)" in cap.stderr
    [line] = rank_lines(tmp_path / "cap", 3, "R3 ")
    assert line == "R3 x [10.0, 11.0, 12.0, 13.0] y [24.0, 24.0, 24.0]"  # 8 copies of rank 3's 3.0
    emu = run_prism([*common, "--log-dir", tmp_path / "emu", "mode=emulate", script], cwd=tmp_path)
    assert emu.returncode == 0, emu.stderr[-3000:]
    assert rank_lines(tmp_path / "emu", 3, "R3 ") == [line]



def test_zero_byte_payload_from_a_virtual_root(tmp_path):
    """An empty broadcast from a virtual rank: the assistant sends nothing for it and the sandbox
    must not wait for a message."""
    common = ["--nproc-per-node", "4", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=30",
              "capture.fold=false", f"trace.dir={tmp_path / 't'}"]
    script = WORKERS / "broadcast_root.py"
    cap = run_prism([*common, "--log-dir", tmp_path / "cap", "mode=capture", script], cwd=tmp_path)
    assert cap.returncode == 0, cap.stderr[-3000:]
    emu = run_prism([*common, "--log-dir", tmp_path / "emu", "mode=emulate", "sandbox.ranks=[3]", script], cwd=tmp_path)
    assert emu.returncode == 0, emu.stderr[-3000:]
    assert rank_lines(tmp_path / "emu", 3, "R3 ") == rank_lines(tmp_path / "cap", 3, "R3 ")


def test_recipe_failing_before_its_first_collective_under_folding(tmp_path):
    """Discovery ends at the program's end when no op comes; the capture then reports the error."""
    script = tmp_path / "broken.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\nraise ValueError('bad recipe')\n")
    r = run_prism(["--nproc-per-node", "4", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "mode=capture",
                   "capture.fold=true", f"trace.dir={tmp_path / 't'}", script], cwd=tmp_path, timeout=120)
    assert r.returncode == 1
    assert "ValueError: bad recipe" in r.stderr and "rank 0 failed" in r.stderr
    assert not (tmp_path / "t").exists()


def test_object_collective_from_an_uncaptured_root_names_the_fix(tmp_path):
    """A torch.distributed.checkpoint save scatters its plan from rank 0 (broadcast_object_list /
    scatter_object_list): a folded capture without rank 0 fails at that call, naming the root and
    the fix, not with an unpickling error from the stand-in's empty buffers (seen on the H200 with
    Megatron-LM's --ckpt-format torch_dist). Capturing rank 0 too, the save is captured and
    emulated: the sandbox ranks write their files as in the capture."""
    script = WORKERS / "dcp_save.py"
    common = ["--nproc-per-node", "8", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60",
              "capture.fold=true", f"trace.dir={tmp_path / 't'}"]
    bad = run_prism([*common, "sandbox.ranks=[3]", "--log-dir", tmp_path / "bad", "mode=capture", script],
                    cwd=tmp_path, timeout=300)
    assert bad.returncode == 1
    assert "UncapturedRootError" in bad.stderr and "from rank 0, which this folded capture does not run" in bad.stderr
    assert "sandbox.ranks=[0,3]" in bad.stderr and "UnpicklingError" not in bad.stderr
    assert not (tmp_path / "t").exists()
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
    cap = run_prism([*common, "sandbox.ranks=[0,3]", "--log-dir", tmp_path / "cap", "mode=capture", script],
                    cwd=tmp_path, timeout=300)
    assert cap.returncode == 0, cap.stderr[-3000:]
    assert "captured 2 of 8 logical ranks (folded)" in cap.stderr
    written = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    assert {".metadata", "__0_0.distcp", "__3_0.distcp"} <= set(written)
    shutil.rmtree(tmp_path / "ckpt")
    emu = run_prism([*common, "sandbox.ranks=[0,3]", "--log-dir", tmp_path / "emu", "mode=emulate", script],
                    cwd=tmp_path, timeout=300)
    assert emu.returncode == 0, emu.stderr[-3000:]
    again = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    # the sandbox ranks' own files, byte for byte (the metadata carries a fresh save id per run)
    assert {k: again[k] for k in ("__0_0.distcp", "__3_0.distcp")} == \
        {k: written[k] for k in ("__0_0.distcp", "__3_0.distcp")}
    assert b"torch.distributed.checkpoint.metadata" in again[".metadata"]


@pytest.mark.parametrize("fold", ["true", "false"])
def test_a_barrier_makes_sandbox_ranks_wait_for_each_other(tmp_path, fold):
    """Two sandbox ranks of one barrier wait for each other in emulation, as in the real job:
    what rank 0 writes before the barrier, rank 3 reads after it (folded or not)."""
    script = WORKERS / "barrier_files.py"
    common = ["--nproc-per-node", "8", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60",
              f"capture.fold={fold}", "sandbox.ranks=[0,3]", f"trace.dir={tmp_path / 't'}"]
    cap = run_prism([*common, "--log-dir", tmp_path / "cap", "mode=capture", script], cwd=tmp_path, timeout=300)
    assert cap.returncode == 0, cap.stderr[-3000:]
    assert rank_lines(tmp_path / "cap", 3, "R3 ") == ["R3 sees ready"]
    (tmp_path / "written_by_rank0").unlink()
    emu = run_prism([*common, "--log-dir", tmp_path / "emu", "mode=emulate", script], cwd=tmp_path, timeout=300)
    assert emu.returncode == 0, emu.stderr[-3000:]
    assert rank_lines(tmp_path / "emu", 3, "R3 ") == ["R3 sees ready"]
