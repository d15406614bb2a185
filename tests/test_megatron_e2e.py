"""The bundled Megatron-core recipe under prism-launch on CPU: capture agrees with a real
run to 1e-5; emulation of sandbox ranks (not rank 0, and two at once) is bit-identical to
the capture in losses, grad norms and parameter checksums."""

import json

import pytest

from tests.conftest import EXAMPLES, logged_metrics, rank_lines, rank_log_dirs, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
JOBS = {
    "dense": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "moe": (4, ["--num-experts", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--moe-aux-loss-coeff", "0.01",
                # chained dense and expert optimizers, parameter all-gathers between their steps
                "--use-distributed-optimizer"]),
}
SANDBOXES = {"dense": [[5], [0, 3]], "moe": [[1], [0, 3]]}


def _flags(nproc: int) -> list:
    return ["--nproc-per-node", str(nproc), "-r", "3", "device=cpu", "comm.timeout_s=120"]


@pytest.fixture(scope="module", params=list(JOBS))
def capture(request, tmp_path_factory):
    name = request.param
    nproc, args = JOBS[name]
    d = tmp_path_factory.mktemp(name)
    r = run_prism([*_flags(nproc), "--log-dir", d / "logs", "mode=capture", f"trace.dir={d / 'trace'}",
                   RECIPE, *args, "--log-all-ranks"], cwd=d, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return name, d


def test_capture_agrees_with_real_run(capture, tmp_path):
    name, d = capture
    nproc, args = JOBS[name]
    r = run_prism([*_flags(nproc), "--log-dir", tmp_path / "logs", "mode=real", RECIPE, *args, "--log-all-ranks"],
                  cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(nproc):
        real, cap = logged_metrics(rank_lines(tmp_path / "logs", rank)), logged_metrics(rank_lines(d / "logs", rank))
        assert len(real) == len(cap) >= 3
        for a, b in zip(real, cap):
            assert a["head"] == b["head"]
            for k in a.keys() - {"head"}:
                assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (rank, k, a[k], b[k])


def test_one_scheduling_unit_per_iteration(capture):
    from prism_launch.trace import TraceReader

    name, d = capture
    nproc, _ = JOBS[name]
    iterations = len({m["head"].split()[-1] for m in logged_metrics(rank_lines(d / "logs", 0))})  # "step N", "rank R iter N"
    markers = [e["rank"] for e in TraceReader(d / "trace").events().to_pylist() if e["kind"] == "marker"]
    assert iterations == 3 and sorted(markers) == sorted(list(range(nproc)) * iterations)


def test_emulation_is_bit_identical(capture, tmp_path):
    name, d = capture
    nproc, args = JOBS[name]
    for sandbox in SANDBOXES[name]:
        out = tmp_path / "-".join(map(str, sandbox))
        r = run_prism([*_flags(nproc), "--log-dir", out / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                       f"sandbox.ranks={json.dumps(sandbox)}", f"report.dir={out / 'report'}",
                       RECIPE, *args, "--log-all-ranks"], cwd=tmp_path, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        report = json.loads((out / "report" / "report.json").read_text())
        for rank in sandbox:
            emu, cap = logged_metrics(rank_lines(out / "logs", rank)), logged_metrics(rank_lines(d / "logs", rank))
            assert len(emu) >= 3
            assert emu == cap, (name, sandbox, rank)  # exact float equality: bit-identical
            entry = report["ranks"][str(rank)]
            assert entry["divergences"] == []
            assert entry["ops"] > 10
        # the virtual ranks never ran: only the sandbox ranks and the assistant (logged under the world size) did
        [run_dir] = list((out / "logs").iterdir())
        assert rank_log_dirs(run_dir) == sorted(sandbox) + [nproc]
        assert sorted(int(r) for r, v in report["ranks"].items() if not v["sandbox"]) == \
            sorted(set(range(nproc)) - set(sandbox))


def test_device_data_path_is_bit_identical(capture, tmp_path):
    """Ops shared only with virtual ranks complete in the sandbox's data path with the virtual
    data prefetched into a pool (CPU here: the same code with host memory as the device)."""
    name, d = capture
    nproc, args = JOBS[name]
    for sandbox, mode in [(SANDBOXES[name][0], "stream"), (SANDBOXES[name][0], "off"), (SANDBOXES[name][1], "preload"),
                          (SANDBOXES[name][1], "inline")]:
        out = tmp_path / f"{mode}-{'-'.join(map(str, sandbox))}"
        r = run_prism([*_flags(nproc), "--log-dir", out / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                       f"sandbox.ranks={json.dumps(sandbox)}", f"report.dir={out / 'report'}",
                       "emulate.data_path=device", f"emulate.prefetch.mode={mode}", "emulate.prefetch.pool_mib=4",
                       RECIPE, *args, "--log-all-ranks"], cwd=tmp_path, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        for rank in sandbox:
            emu, cap = logged_metrics(rank_lines(out / "logs", rank)), logged_metrics(rank_lines(d / "logs", rank))
            assert len(emu) >= 3 and emu == cap, (name, sandbox, mode, rank)
            summary = json.loads((out / "report" / "sandbox" / f"rank{rank}.json").read_text())
            assert summary["divergences"] == []
            p = summary["prefetch"]
            assert p["mode"] == mode and p["staged_ops"] > 10 and p["checks"] > 0, p
            assert p["hits"] + p["in_flight"] + p["stalls"] == p["staged_ops"], p
            if mode == "off":
                assert p["stalls"] == p["staged_ops"]
            if mode == "stream":
                assert p["high_water_bytes"] <= p["pool_bytes"] and p["hits"] > 0
            if mode == "inline":  # from the host tier, on the program's thread
                assert p["host_tier_bytes"] > 0 and p["stager_batches"] == 0 and 0 < p["copies"] <= p["staged_ops"], p
                assert p["high_water_bytes"] <= p["pool_bytes"] and p["hits"] > 0


def test_pruned_rings_under_ordered_matching_are_bit_identical(capture, tmp_path):
    """Two sandbox ranks with virtual ranks between them in shared groups — dense 0 and 5:
    the world and the model-parallel group [0, 1, 4, 5] (Megatron's grad-norm and found-inf
    all-reduces); MoE 0 and 3: the world — run those groups' all-reduces, reduce-scatters and
    all-gathers over pruned rings (live members plus the assistant's edges) with messages
    matched by issue order only (NCCL's rule); every logged number stays bit-identical."""
    name, d = capture
    nproc, args = JOBS[name]
    sandbox = {"dense": [0, 5], "moe": [0, 3]}[name]
    r = run_prism([*_flags(nproc), "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                   f"sandbox.ranks={json.dumps(sandbox)}", f"report.dir={tmp_path / 'report'}",
                   "emulate.pruned_rings=true", "emulate.ring_tags=false", RECIPE, *args, "--log-all-ranks"],
                  cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in sandbox:
        emu, cap = logged_metrics(rank_lines(tmp_path / "logs", rank)), logged_metrics(rank_lines(d / "logs", rank))
        assert len(emu) >= 3 and emu == cap, rank
        summary = json.loads((tmp_path / "report" / "sandbox" / f"rank{rank}.json").read_text())
        assert summary["divergences"] == [] and summary["ring_groups"] >= 1
    assistant = json.loads((tmp_path / "report" / "report.json").read_text())["assistant"]
    assert assistant["ring_ops"] >= 3 and assistant["ring_groups"] >= 1, assistant
