"""Sweep summary (CSV, ranked table, plot) from synthetic reports, invalid points as rows,
launcher configs, and the single-run ConfigError for an invalid target.parallel (no runs)."""

import csv
import io
import json
from pathlib import Path

import pytest

from prism_launch.launch.args import parse
from prism_launch.config import compose, resolve
from prism_launch.sweep import (collect_rows, print_table, ranked, run_point, summarize_report, varying,
                                write_summary)
from tests.conftest import EXAMPLES

RECIPE = EXAMPLES / "megatron_gpt.py"


def _report(it, peaks, oom=(), moe=None):
    rep = {"world_size": 16, "predicted": {"iteration_time_s": it, "oom_ranks": list(oom)},
           "ranks": {str(r): {"peak_memory_bytes": p} for r, p in enumerate(peaks)}}
    if moe is not None:
        rep["moe"] = {"overall": {"expert_imbalance": moe, "ep_rank_imbalance": moe / 2, "dropped_tokens": 7,
                                  "aux_loss": 1.0625, "aux_loss_name": "load_balancing_loss"},
                      "effect": {"a2a_wait_excess_s": 0.001}}
    return rep


def _rows():
    rows = []
    for i, (tp, rep) in enumerate([(1, _report(0.20, [3 << 20, 5 << 20])),
                                   (2, _report(0.10, [2 << 20, None], oom=[1], moe=1.5)),
                                   (4, None)]):
        row = {"point": i, "overrides": ["device=cpu", f"target.parallel.tp={tp}"], "status": "ok"}
        if rep is None:
            row["status"] = "invalid: target.parallel.tp=4: tp x pp x cp = 4x1x1 = 4 does not divide the world of 6"
        else:
            row.update(summarize_report(rep))
        rows.append(row)
    return rows


def test_summarize_report():
    s = summarize_report(_report(0.25, [1, 9, None, 4], oom=[1], moe=1.25))
    assert s["iteration_time_s"] == 0.25 and s["peak_memory_bytes"] == 9 and s["oom"] is True
    assert s["oom_ranks"] == 1 and s["moe_expert_imbalance"] == 1.25 and s["moe_dropped_tokens"] == 7
    assert s["moe_aux_loss"] == 1.0625
    assert summarize_report(_report(0.1, [1]))["moe_expert_imbalance"] is None


def test_summary_csv_plot_and_ranked_table(tmp_path):
    rows = _rows()
    csv_path, png_path = write_summary(rows, tmp_path / "sweep")
    got = list(csv.DictReader(open(csv_path)))
    assert [r["overrides"] for r in got] == ["target.parallel.tp=1", "target.parallel.tp=2", "target.parallel.tp=4"]
    assert got[1]["oom"] == "True" and got[1]["peak_memory_bytes"] == str(2 << 20)
    assert got[1]["moe_expert_imbalance"] == "1.5" and got[0]["moe_expert_imbalance"] == ""
    assert got[1]["moe_aux_loss"] == "1.0625" and got[1]["moe_dropped_tokens"] == "7"
    assert got[2]["status"].startswith("invalid: target.parallel.tp=4")
    assert png_path.stat().st_size > 10_000 and png_path.read_bytes()[:4] == b"\x89PNG"
    assert [r["point"] for r in ranked(rows)] == [1, 0, 2]
    buf = io.StringIO()
    print_table(rows, file=buf)
    text = buf.getvalue()
    assert text.index("100.00") < text.index("200.00") < text.index("invalid")
    assert "MoE aux loss" in text and "1.062" in text  # beside the point's time, dropped tokens and imbalance
    assert varying(rows)[0] == "target.parallel.tp=1"


def test_invalid_point_is_a_row_not_a_crash(tmp_path):
    args = parse(["--nproc-per-node", "6", str(RECIPE), "--num-layers", "4"])
    cfg = compose(["device=cpu", "target.parallel.tp=4"])
    row = run_point(cfg, args, tmp_path / "0", 0, ["device=cpu", "target.parallel.tp=4"])
    assert row["status"].startswith("invalid: target.parallel.tp=4: tp x pp x cp"), row["status"]
    assert row["world_size"] == 6 and row["iteration_time_s"] is None
    assert json.loads((tmp_path / "0" / "result.json").read_text())["status"] == row["status"]
    cfg = compose(["device=cpu", "target.parallel.pp=3"])
    row = run_point(cfg, args, tmp_path / "1", 1, [])
    assert row["status"] == "invalid: target.parallel.pp=3: must divide --num-layers=4"


def test_collect_rows_from_job_returns(tmp_path):
    from hydra.core.utils import JobReturn, JobStatus

    ok = JobReturn(overrides=["a=1"], status=JobStatus.COMPLETED, _return_value={"point": 1, "status": "ok"})
    bad = JobReturn(overrides=["a=2"], status=JobStatus.FAILED, _return_value=RuntimeError("boom\nmore"))
    rows = collect_rows([[bad, ok]], tmp_path)
    assert rows[0] == {"point": 1, "status": "ok"}
    assert rows[1]["status"] == "failed: RuntimeError: boom" and rows[1]["overrides"] == ["a=2"]


def test_single_run_invalid_parallel_is_exit_2(capsys):
    from prism_launch.cli import main

    assert main(["--nproc-per-node", "4", "device=cpu", "target.parallel.tp=3", str(RECIPE)]) == 2
    assert "target.parallel.tp=3" in capsys.readouterr().err
    assert main(["--nproc-per-node", "4", "device=cpu", "target.parallel.tp=0", str(RECIPE)]) == 2
    assert "target.parallel.tp must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("launcher,target", [
    ("prism_joblib", "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"),
    ("prism_local", "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"),
    ("prism_slurm", "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"),
    ("prism_ray", "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"),
])
def test_launcher_configs_compose(launcher, target):
    if launcher == "prism_ray":
        pytest.importorskip("ray")
        pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from prism_launch.config import config_dir, register

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=[f"hydra/launcher={launcher}"],
                                return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    assert cfg.hydra.launcher._target_ == target
    if launcher == "prism_slurm":
        assert cfg.hydra.launcher.gpus_per_node == 8 and cfg.hydra.launcher.nodes == 1
