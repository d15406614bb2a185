"""Folded capture's choice of ranks, on megatron-core's real group layouts (discovered the way
the launcher does: one rank run up to its first collective) and on synthetic ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache

import pytest

from prism_launch.capture.fold import FoldError, FoldPlan, plan
from prism_launch.config.plan import CapturePlan, RankPlan
from tests.conftest import ROOT, WORKERS, _env

PATTERNS = ["DATA_PARALLEL", "HYBRID_DP", "DISTRIBUTED_OPTIMIZER_INSTANCE", "default_pg"]


@cache
def megatron_groups(world: int, rank: int, delegation: bool = True, **sizes) -> tuple:
    out = (f"/tmp/prism-layout-{os.getpid()}-{world}-{rank}-{int(delegation)}-"
           f"{'-'.join(f'{k}{v}' for k, v in sorted(sizes.items()))}.json")
    rank_plan = RankPlan(mode="capture", device="cpu", timeout_s=120, local_ranks=(rank,), memory_track=False,
                         subgroups="auto" if delegation else "intercept", capture=CapturePlan(discover_file=out))
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", **rank_plan.to_env(),
           **{k.upper(): str(v) for k, v in sizes.items()}}
    r = subprocess.run([sys.executable, "-m", "prism_launch.rank.bootstrap", str(WORKERS / "layout.py")], cwd=ROOT,
                       env=_env(env), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out) as f:
        groups = json.load(f)["groups"]
    os.unlink(out)
    return tuple((tuple(g), d) for g, d in groups)


def by_desc(groups, desc: str, rank: int) -> set[int]:
    [g] = [set(r) for r, d in groups if d == desc and rank in r]
    return g


def check_plan(p: FoldPlan, groups, world: int) -> None:
    """Invariants: closed under model-parallel groups; every uncaptured rank mirrors a captured
    rank holding the same model shard (same data-parallel groups)."""
    captured = set(p.captured)
    for ranks, desc in groups:
        if len(ranks) < world and not any(x in desc for x in PATTERNS) and captured & set(ranks):
            assert set(ranks) <= captured, (desc, ranks)
    for u in range(world):
        if u in captured:
            assert p.rep[u] == u
            continue
        assert p.rep[u] in captured
        for ranks, desc in groups:
            if desc in ("DATA_PARALLEL_GROUP", "EXPERT_DATA_PARALLEL_GROUP") and u in ranks:
                assert p.rep[u] in ranks, (u, p.rep[u], desc)


def test_dense_tp_pp_folds_to_one_replica():
    groups = megatron_groups(16, 10, tp=2, pp=2)
    p = plan(groups, [10], 16, PATTERNS)
    assert p.captured == [2, 3, 10, 11]  # TP pair {10, 11} and its pipeline peers {2, 3}
    assert p.folded
    check_plan(p, groups, 16)
    assert p.rep[14] == 10 and p.rep[15] == 11 and p.rep[0] == 2
    dp = sorted(by_desc(groups, "DATA_PARALLEL_GROUP", 10))
    assert p.sources(dp) == tuple(10 for _ in dp)


def test_context_parallel_is_followed():
    groups = megatron_groups(32, 5, tp=2, pp=2, cp=2)
    p = plan(groups, [5], 32, PATTERNS)
    assert len(p.captured) == 8  # tp·cp·pp
    assert by_desc(groups, "CONTEXT_PARALLEL_GROUP", 5) <= set(p.captured)
    check_plan(p, groups, 32)


def test_expert_parallel_spans_data_parallel_replicas():
    groups = megatron_groups(16, 3, pp=2, ep=4)
    p = plan(groups, [3], 16, PATTERNS)
    ep = by_desc(groups, "EXPERT_MODEL_PARALLEL_GROUP", 3)
    assert ep <= set(p.captured) and len(ep) == 4
    assert len(p.captured) == 8  # ep·pp
    check_plan(p, groups, 16)


def test_tensor_and_expert_parallel():
    groups = megatron_groups(16, 6, tp=2, ep=2, etp=1)
    p = plan(groups, [6], 16, PATTERNS)
    check_plan(p, groups, 16)
    assert 6 in p.captured and len(p.captured) < 16


def test_two_sandboxes_in_different_replicas():
    groups = megatron_groups(16, 0, tp=2, pp=2)
    p = plan(groups, [0, 13], 16, PATTERNS)
    assert p.captured == [0, 1, 4, 5, 8, 9, 12, 13]
    check_plan(p, groups, 16)
    dp = sorted(by_desc(groups, "DATA_PARALLEL_GROUP", 0))  # [0, 2, 4, 6]: 0 and 4 captured
    src = p.sources(dp)
    assert set(src) <= {0, 4} and src[0] == 0 and src[2] == 4


def test_tensor_parallel_positions_are_sampled():
    """TP8·PP2 (megatron-core's layout), sandbox at TP position 7 of the last stage: positions 0 and
    7 of each stage are captured, not all 16 ranks; every other TP rank mirrors position 7 of its own
    stage, and the replicas' ranks mirror the same stage's captured rank at their mirroring position."""
    world = 32
    groups = megatron_groups(world, 31, tp=8, pp=2)
    whole = plan(groups, [31], world, PATTERNS)
    assert len(whole.captured) == 16
    p = plan(groups, [31], world, PATTERNS, tp_sample=2)
    assert p.tp_positions == [0, 7]
    tp = {r: sorted(by_desc(groups, "TENSOR_MODEL_PARALLEL_GROUP", r)) for r in range(world)}
    pp = {r: by_desc(groups, "PIPELINE_MODEL_PARALLEL_GROUP", r) for r in range(world)}
    assert p.captured == sorted({tp[r][0] for r in pp[31]} | pp[31]) and len(p.captured) == 4
    for u in range(world):
        c = p.rep[u]
        assert c in p.captured
        stage = lambda r: next(i for i, m in enumerate(sorted(pp[r])) if m == r)  # noqa: E731
        assert stage(c) == stage(u)  # the same stage: the same shapes
        assert (tp[c].index(c) == 0) == (tp[u].index(u) == 0)  # position 0 only mirrors position 0
    assert FoldPlan.from_dict(p.to_dict()).tp_positions == [0, 7]
    # a member of a tensor-parallel group whose captured members are 0 and 7 stands in at the op
    src = p.sources(tp[31])
    assert src == tuple(r if tp[31].index(r) in (0, 7) else 31 for r in tp[31])
    # the sandbox at position 0, four samples: 0, 2, 4, 6
    q = plan(groups, [24], world, PATTERNS, tp_sample=4)
    assert q.tp_positions == [0, 2, 4, 6] and len(q.captured) == 8
    assert plan(groups, [31], world, PATTERNS, tp_sample=8).tp_positions == []  # the whole group: nothing sampled


def test_mirror_position():
    from prism_launch.capture.fold import tp_mirror_position

    assert [tp_mirror_position(q, [0, 7]) for q in range(8)] == [7] * 8
    assert [tp_mirror_position(q, [0, 3, 6]) for q in range(8)] == [3, 3, 3, 3, 3, 6, 6, 6]
    assert tp_mirror_position(5, [0]) == 0


def test_synthetic_layouts():
    world = 8
    groups = [(tuple(range(8)), "default_pg"), ((0, 1), "TP"), ((2, 3), "TP"), ((4, 5), "TP"), ((6, 7), "TP"),
              ((0, 2, 4, 6), "DATA_PARALLEL_GROUP"), ((1, 3, 5, 7), "DATA_PARALLEL_GROUP")]
    p = plan(groups, [2], world, PATTERNS)
    assert p.captured == [2, 3] and p.rep == [2, 3, 2, 3, 2, 3, 2, 3]
    # an undescribed group is followed: folding only gets more conservative
    p = plan([*groups, ((3, 5), "")], [2], world, PATTERNS)
    assert p.captured == [2, 3, 4, 5]
    assert plan(groups, range(8), world, PATTERNS).folded is False
    assert FoldPlan.from_dict(p.to_dict()).rep == p.rep
    with pytest.raises(FoldError, match="outside the world"):
        plan(groups, [9], world, PATTERNS)
    assert p.sources((0, 1)) is None  # no captured member: never used by the capture


def test_subgroups_without_new_group_delegation():
    """torch < 2.13 does not hand new_group to the default group: the interception below the
    public API must see (and make prism groups of) exactly the same groups, gloo ones included."""
    with_delegation = megatron_groups(16, 10, tp=2, pp=2)
    without = megatron_groups(16, 10, delegation=False, tp=2, pp=2)
    assert len(with_delegation) > 20
    assert [sorted(r) for r, _ in without] == [sorted(r) for r, _ in with_delegation]
    assert [d for _, d in without] == [d for _, d in with_delegation]
