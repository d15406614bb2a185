"""Tensor-parallel sampling of a folded ``payload=none`` capture (``capture.tp_sample``), on the
bundled megatron-core recipe at TP4·PP2·DP2 (16 ranks, folded), sandbox rank 15 (TP position 3 of
the last stage): the default captures TP positions 0 and 3 of each stage (4 ranks), and every
uncaptured rank does, op for op, what its stand-in does, checked against a capture of the whole TP
groups (8 ranks) of the same job."""

import json

import pytest

from prism_launch.trace import TraceReader
from tests.conftest import EXAMPLES, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
ARGS = [RECIPE, "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2", "--train-iters", "3"]
FLAGS = ["--nnodes", "2", "--nproc-per-node", "8", "device=cpu", "comm.timeout_s=120", "capture.payload=none",
         "capture.fold=true", "sandbox.ranks=[15]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_sample")
    sampled = run_prism([*FLAGS, f"trace.dir={d / 'sampled'}", *ARGS], cwd=d, timeout=600)
    assert sampled.returncode == 0, sampled.stderr[-4000:]
    whole = run_prism([*FLAGS, "mode=capture", "capture.tp_sample=0", f"trace.dir={d / 'whole'}", *ARGS],
                      cwd=d, timeout=600)
    assert whole.returncode == 0, whole.stderr[-4000:]
    return d, sampled.stderr, whole.stderr


def _ops(reader: TraceReader, rank: int) -> list[tuple]:
    """A rank's events as what it did: kind, op, bytes, shape, and the group by its description and
    the member's position in it (group ids differ between traces)."""
    groups = {int(g["id"]): g for g in reader.manifest.groups}
    out = []
    for e in reader.events_for_rank(rank):
        g = groups.get(int(e["group"]))
        where = (g.get("desc"), len(g["ranks"])) if g else None
        out.append((e["kind"], e["op"], e["nbytes"], tuple(e["shape"] or ()), where, e["peer"] >= 0))
    return out


def test_two_positions_of_each_tensor_parallel_group_are_captured(runs):
    d, err, whole_err = runs
    assert "captured 4 of 16 logical ranks (folded)" in err
    assert "TP positions [0, 3] of each tensor-parallel group (capture.tp_sample)" in err
    assert "captured 8 of 16 logical ranks (folded)" in whole_err
    fold = json.loads((d / "sampled" / "fold.json").read_text())
    assert fold["captured"] == [4, 7, 12, 15] and fold["tp_positions"] == [0, 3]
    assert [fold["rep"][r] for r in (5, 6, 13, 14, 0, 1, 8, 11)] == [7, 7, 15, 15, 4, 7, 12, 15]


def test_every_uncaptured_rank_does_what_its_stand_in_does(runs):
    d, _err, _ = runs
    sampled, whole = TraceReader(d / "sampled"), TraceReader(d / "whole")
    rep = json.loads((d / "sampled" / "fold.json").read_text())["rep"]
    whole_captured = json.loads((d / "whole" / "fold.json").read_text())["captured"]
    assert whole_captured == [4, 5, 6, 7, 12, 13, 14, 15]
    for rank in whole_captured:
        mine, stand_in = _ops(whole, rank), _ops(sampled, rep[rank])
        assert len(mine) > 100 and mine == stand_in, rank


def test_the_prediction_covers_the_whole_world(runs):
    d, err, _ = runs
    report = json.loads((d / "sampled" / "report" / "report.json").read_text())
    assert report["predicted"]["iteration_time_s"] > 0 and report["fold"]["captured_ranks"] == 4
    assert report["fold"]["tensor_parallel"]["captured_tp_positions"] == [0, 3]
    tp_groups = [g for g in report["fold"]["approximated_model_parallel_groups"]
                 if g["desc"] == "TENSOR_MODEL_PARALLEL_GROUP"]
    assert sorted(g["ranks"] for g in tp_groups) == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert "divergences 0" in err


def test_with_the_same_spans_both_captures_predict_the_same_step(runs):
    """Given every event the same compute span in both traces (a function of what the event is,
    not of the capture's noise), the replay of the sampled trace and of the whole-TP trace predict
    the same iteration times on the same cluster: the uncaptured TP ranks add nothing a mirror
    does not."""
    from prism_launch.config.cluster import load_cluster
    from prism_launch.predict.cost_model import make_cost_model
    from prism_launch.predict.simulate import graph_from_events, replay

    d, _err, _ = runs
    times = []
    for name in ("sampled", "whole"):
        reader = TraceReader(d / name)
        rows = reader.events().to_pylist()
        for row in rows:
            row["compute_wall_s"] = 1e-4 * (1 + row["nbytes"] % 7) + (2e-3 if row["kind"] == "marker" else 0.0)
        groups = {int(g["id"]): tuple(g["ranks"]) for g in reader.manifest.groups}
        graph = graph_from_events(rows, groups, reader.manifest.world_size, compute="wall")
        times.append(replay(graph, make_cost_model("nccl", load_cluster("h100_ib"))).iteration_times)
    assert len(times[0]) == 3 and min(times[0]) > 0.01 and times[0] == pytest.approx(times[1], rel=1e-9)
