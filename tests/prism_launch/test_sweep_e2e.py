"""prism-launch --multirun end to end: the bundled recipe at 4 logical ranks, two points,
with Hydra's basic launcher (in-process, sequential) and with submitit's local executor;
and repeated in-process sweeps leave no signal handler, thread or Hydra state behind."""

import csv
import json
import signal
import threading
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, WORKERS, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"


@pytest.fixture(scope="module")
def cwd(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sweep")  # traces (prism_traces/) shared by the tests below


def _sweep(cwd: Path, sweep_dir: Path, *extra: str):
    r = run_prism(["--multirun", "--nproc-per-node", "4", "-r", "3", "device=cpu", "comm.timeout_s=120",
                   f"hydra.sweep.dir={sweep_dir}", *extra, "target.parallel.tp=1,2",
                   RECIPE, "--train-iters", "2", "--num-layers", "2"], cwd=cwd, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = list(csv.DictReader(open(sweep_dir / "summary.csv")))
    assert [row["overrides"] for row in rows] == ["target.parallel.tp=1", "target.parallel.tp=2"]
    assert all(row["status"] == "ok" for row in rows), rows
    assert (sweep_dir / "summary.png").exists()
    assert "ranked by iteration_time_s" in r.stderr
    return rows, r


def test_basic_launcher_two_points(cwd):
    sweep_dir = cwd / "basic"
    rows, r = _sweep(cwd, sweep_dir)
    assert "sweep point 1/2 " in r.stderr and "sweep point 2/2 " in r.stderr  # progress in batch logs
    traces = set()
    for n, row in enumerate(rows):
        report = json.loads((sweep_dir / str(n) / "report" / "report.json").read_text())
        assert float(row["iteration_time_s"]) == report["predicted"]["iteration_time_s"] > 0
        assert int(row["peak_memory_bytes"]) == max(v["peak_memory_bytes"] for v in report["ranks"].values()
                                                    if v.get("peak_memory_bytes") is not None)
        assert report["world_size"] == 4
        traces.add(report["trace_dir"])
        assert f"--tensor-model-parallel-size {n + 1}" in row["script_args"]
        assert (sweep_dir / str(n) / ".hydra" / "overrides.yaml").exists()
    assert len(traces) == 2  # one trace per point: rendering happens before fingerprinting


def test_submitit_local_two_points(cwd):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep_dir = cwd / "submitit"
    rows, _ = _sweep(cwd, sweep_dir, "hydra/launcher=prism_local")
    assert (sweep_dir / ".submitit").is_dir()
    assert all((sweep_dir / str(n) / "report" / "report.json").exists() for n in range(2))


def test_in_process_sweeps_leave_no_state(tmp_path, monkeypatch):
    from hydra.core.global_hydra import GlobalHydra

    from prism_launch.cli import main

    monkeypatch.chdir(tmp_path)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    def started():
        # everything the sweep itself starts must be gone; threads left by earlier tests in this
        # process may end meanwhile (a fake's wait running out), which is no state of the sweep's
        return sorted(t.name for t in threading.enumerate() if t not in before)

    before = set(threading.enumerate())
    import logging

    log_handlers = list(logging.getLogger().handlers)
    for i in range(2):
        rc = main(["--multirun", "--nproc-per-node", "2", "-r", "3", "device=cpu", "comm.timeout_s=60",
                   f"hydra.sweep.dir={tmp_path / str(i)}", "script.args.unused=1,2", str(WORKERS / "collectives.py")])
        assert rc == 0
        rows = list(csv.DictReader(open(tmp_path / str(i) / "summary.csv")))
        assert [r["status"] for r in rows] == ["ok", "ok"] and rows[1]["script_args"] == "--unused 2"
        assert {s: signal.getsignal(s) for s in handlers} == handlers
        assert started() == []
        assert not GlobalHydra.instance().is_initialized()
        assert logging.getLogger().handlers == log_handlers


def test_a_router_sweep_ranks_points_with_their_aux_loss_dropped_tokens_and_imbalance(cwd):
    """The bundled recipe as an EP2 MoE job (4 experts, top-2, aux-loss coefficient 0.01) swept
    over dropless against capacity factor 1.0 through the recipe's own flag (``false`` removes
    it): every point's row carries its routers' load-balancing loss, dropped tokens and
    imbalance, and the ranked table shows them beside the iteration time."""
    sweep_dir = cwd / "router"
    r = run_prism(["--multirun", "--nproc-per-node", "4", "-r", "3", "device=cpu", "comm.timeout_s=120",
                   f"hydra.sweep.dir={sweep_dir}", "script.args.moe_expert_capacity_factor=false,1.0",
                   RECIPE, "--train-iters", "3", "--num-layers", "2", "--num-experts", "4",
                   "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01"], cwd=cwd, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = list(csv.DictReader(open(sweep_dir / "summary.csv")))
    assert [row["overrides"] for row in rows] == ["script.args.moe_expert_capacity_factor=False",
                                                  "script.args.moe_expert_capacity_factor=1.0"]
    assert all(row["status"] == "ok" for row in rows), rows
    dropless, capped = rows
    assert "--moe-expert-capacity-factor" not in dropless["script_args"]
    assert "--moe-expert-capacity-factor 1.0" in capped["script_args"]
    # the capacity drops what the routers sent over it (their pre-drop counts ride the dispatch: TP1 makes
    # no aux-loss all-reduce to read them from), and evens the experts out
    assert int(dropless["moe_dropped_tokens"]) == 0 < int(capped["moe_dropped_tokens"])
    assert float(capped["moe_expert_imbalance"]) < float(dropless["moe_expert_imbalance"])
    for row in rows:
        assert 0.5 < float(row["moe_aux_loss"]) < 2.0  # E * sum(f_e * P_e) / top-k: about 1
        assert float(row["moe_expert_imbalance"]) >= 1.0 and float(row["iteration_time_s"]) > 0
        report = json.loads((sweep_dir / str(rows.index(row)) / "report" / "report.json").read_text())
        assert float(row["moe_aux_loss"]) == report["moe"]["overall"]["aux_loss"]
    assert "MoE aux loss" in r.stderr and "MoE dropped" in r.stderr
