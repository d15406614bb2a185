"""MoE routing statistics on a synthetic trace shaped like megatron-core's alltoall token
dispatcher: per-expert counts all-gathered, then all_to_all_single with those splits."""

import json

import pytest
import torch

from integrations.megatron_moe import find_dispatches
from prism_launch.config import compose, resolve
from prism_launch.report.moe_stats import aggregate, moe_stats
from prism_launch.trace import TraceReader, TraceWriter

E, H = 4, 8
GROUPS = {0: (0, 1, 2, 3), 1: (0, 1), 2: (2, 3), 3: (0, 1), 4: (2, 3), 5: (0, 1), 6: (2, 3)}
# per step, per rank: (pre-drop counts, routed counts after capacity dropping)
COUNTS = {
    0: {0: ([10, 6, 3, 1], [8, 6, 3, 1]), 1: ([9, 7, 2, 2], [8, 7, 2, 2]),
        2: ([5, 5, 5, 5], [5, 5, 5, 5]), 3: ([6, 4, 5, 5], [6, 4, 5, 5])},
    1: {0: ([4, 4, 6, 6], [4, 4, 6, 6]), 1: ([3, 5, 6, 6], [3, 5, 6, 6]),
        2: ([5, 5, 5, 5], [5, 5, 5, 5]), 3: ([6, 4, 5, 5], [6, 4, 5, 5])},
}
EP = {0: 1, 1: 1, 2: 2, 3: 2}        # rank -> EP group id (all_to_all)
GATHER = {0: 3, 1: 3, 2: 4, 3: 4}    # rank -> tensor x expert parallel group (all_gather of counts)
AUX = {0: 5, 1: 5, 2: 6, 3: 6}       # rank -> tensor x context parallel group (aux-loss all-reduce)


def _rows_and_tensors(loaded_rank=1, slow_s=0.05):
    rows, tensors, idx = [], {r: {} for r in range(4)}, {r: 0 for r in range(4)}

    def add(rank, **kw):
        row = {"rank": rank, "idx": idx[rank], "compute_cpu_s": 0.001, "compute_wall_s": 0.001, **kw}
        idx[rank] += 1
        rows.append(row)

    for unit, per_rank in COUNTS.items():
        for r, (pre, routed) in per_rank.items():
            for kind, op, gid, vals in (("all_reduce", "allreduce", AUX[r], pre), ("all_gather", "all_gather_single",
                                                                                   GATHER[r], routed)):
                key = f"c/{gid}/{unit}/0"
                tensors[r][key] = torch.tensor(vals, dtype=torch.int64)
                add(r, unit=unit, kind="collective", op=op, group=gid, seq=unit, dtype="int64", shape=[E], nbytes=8 * E,
                    tensor_key=key, extra=json.dumps({"kind": kind, "shapes": [[E]], "dtypes": ["int64"]}))
                add(r, unit=unit, kind="wait", op="wait", group=gid, seq=unit, extra=json.dumps({"ref": "c"}))
            splits = [sum(routed[:2]), sum(routed[2:])]
            add(r, unit=unit, kind="collective", op="all_to_all_single", group=EP[r], seq=unit, dtype="float32",
                shape=[splits[0], H], nbytes=4 * H * sum(splits), tensor_key=None,
                compute_cpu_s=slow_s if r == loaded_rank else 0.001,
                extra=json.dumps({"kind": "all_to_all", "shapes": [[s, H] for s in splits]}))
            add(r, unit=unit, kind="wait", op="wait", group=EP[r], seq=unit, extra=json.dumps({"ref": "c"}))
            add(r, unit=unit, kind="marker", op="step")
    return rows, tensors


def test_find_and_aggregate():
    rows, tensors = _rows_and_tensors()
    found = find_dispatches(rows, GROUPS, lambda r, k: tensors[r][k], script_args=[])
    assert len(found["dispatches"]) == 4  # 2 steps x 2 EP groups
    stats = aggregate(found, rows)
    assert stats["dispatches_verified"] == 4
    s0 = stats["per_step"][0]
    assert s0["tokens_per_expert"] == [8 + 8 + 5 + 6, 6 + 7 + 5 + 4, 3 + 2 + 5 + 5, 1 + 2 + 5 + 5]
    assert s0["expert_imbalance"] == pytest.approx(27 / (77 / 4))
    # step 0: rank 0 (EP rank 0 of [0,1]) receives experts 0-1 of ranks 0 and 1
    pr = stats["per_rank"]
    assert pr["0"]["received_tokens"][0] == 8 + 6 + 8 + 7 and pr["1"]["received_tokens"][0] == 3 + 1 + 2 + 2
    assert pr["0"]["sent_tokens"][0] == 18
    assert pr["0"]["dropped_tokens"] == [2, 0] and pr["1"]["dropped_tokens"] == [1, 0]
    assert stats["overall"]["dropped_tokens"] == 3
    assert pr["2"]["a2a_bytes"][0] == 4 * H * 20
    assert "aux-loss" in stats["dropped_source"]
    per_ep_rank = stats["overall"]["tokens_per_ep_rank"]
    assert per_ep_rank == {"0": 45, "1": 32, "2": 40, "3": 40}
    assert stats["overall"]["ep_rank_imbalance"] == pytest.approx(45 / (157 / 4))


def test_dropped_without_aux_loss_from_flags_or_not_derivable():
    rows, tensors = _rows_and_tensors()
    rows = [r for r in rows if not (r["kind"] == "collective" and r["op"] == "allreduce")]
    read = lambda r, k: tensors[r][k]  # noqa: E731
    found = find_dispatches(rows, GROUPS, read, script_args=["--moe-expert-capacity-factor", "1.0"])
    assert aggregate(found, rows)["overall"]["dropped_tokens"] is None
    assert any("not derivable" in n for n in found["notes"])
    args = ["--moe-expert-capacity-factor", "1.0", "--seq-length", "20", "--micro-batch-size", "1",
            "--moe-router-topk", "1"]
    stats = aggregate(find_dispatches(rows, GROUPS, read, script_args=args), rows)
    assert stats["per_rank"]["0"]["dropped_tokens"] == [2, 0]
    dropless = aggregate(find_dispatches(rows, GROUPS, read, script_args=[]), rows)
    assert dropless["overall"]["dropped_tokens"] == 0 and "dropless" in dropless["dropped_source"]


def test_no_dispatch_no_section():
    rows, tensors = _rows_and_tensors()
    rows = [r for r in rows if r["op"] != "all_to_all_single"]
    assert aggregate(find_dispatches(rows, GROUPS, lambda r, k: tensors[r][k]), rows) is None


def test_moe_stats_from_trace_with_replayed_effect(tmp_path):
    rows, tensors = _rows_and_tensors(loaded_rank=0, slow_s=0.05)
    with TraceWriter(tmp_path / "trace") as w:
        w.add_events(rows)
        for r in range(4):
            w.add_tensors(r, tensors[r])
        w.commit(fingerprint={}, versions={}, world_size=4, topology={},
                 groups=[{"id": g, "ranks": list(rs), "key": str(g), "desc": ""} for g, rs in GROUPS.items()],
                 ranks_captured=[0, 1, 2, 3], extra={"script_args": []})
    cfg = resolve(compose(["device=cpu", "target.world_size=4"]))
    stats = moe_stats(cfg, TraceReader(tmp_path / "trace"), tmp_path / "trace")
    assert stats["dispatches"] == 4 and stats["overall"]["dropped_tokens"] == 3
    eff = stats["effect"]
    # rank 0 receives the most tokens and computes 50 ms before the all-to-all; rank 1 waits for it
    assert eff["most_loaded_rank"] == 0
    assert eff["per_rank"]["1"]["a2a_wait_s"] > 0.04 and eff["per_rank"]["0"]["a2a_wait_s"] < 0.01
    assert eff["a2a_wait_excess_s"] > 0.01
