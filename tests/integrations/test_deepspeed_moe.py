"""DeepSpeed MoE routing statistics: the gate's counts read from DeepSpeed's own gating functions,
attached to the dispatch all-to-all only, found in events and aggregated; DeepSpeed's EP groups
sampled by EP folding; the detector chosen for DeepSpeed recipes."""

import json

import pytest
import torch

from integrations.deepspeed_gate_counts import HEADER, TAG, decode, encode, gate_counts
from integrations.deepspeed_moe import find_dispatches
from nccl_ext.core import routing_counts
from nccl_ext.core.ops import Collective
from prism_launch.capture.fold import plan
from prism_launch.config import registry
from prism_launch.report.moe_stats import aggregate

sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe", reason="DeepSpeed is not installed")


def _logits(tokens=32, experts=4, hot=2):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, hot] += 1.5  # most tokens prefer expert `hot`: the capacity drops some
    return logits


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("k", [1, 2])
def test_counts_from_deepspeeds_own_gates(k, sparse):
    logits = _logits()
    top = logits.topk(k, dim=1).indices.reshape(-1)
    wanted = torch.bincount(top, minlength=4).tolist()
    if k == 1:
        out = sharded_moe.top1gating(logits, 1.0, 4, use_rts=False, sparse_routes=sparse)
    else:
        out = sharded_moe.top2gating(logits, 1.0, 4, top2_2nd_expert_sampling=False, sparse_routes=sparse)
    capacity, exp_counts, routed = gate_counts(out)
    assert capacity == 8 * k  # ceil(32 tokens / 4 experts * capacity factor k)
    assert exp_counts == wanted  # before the capacity limit: the top-k itself
    assert routed == [min(n, capacity) for n in wanted]  # the capacity keeps the first `capacity` routes
    assert sum(exp_counts) - sum(routed) > 0  # the planted hot expert overflows


def test_values_round_trip_and_other_integers_are_no_gate_counts():
    v = encode(3, 16, [18, 10, 24, 12], [16, 10, 16, 12])
    assert v[:HEADER] == [TAG, 3, 4, 16]
    assert decode(v) == {"layer": 3, "num_experts": 4, "capacity": 16, "exp_counts": [18, 10, 24, 12],
                         "routed": [16, 10, 16, 12]}
    assert decode([5, 0, 2, 1]) is None and decode(v[:-1]) is None
    with pytest.raises(ValueError, match="one per expert"):
        encode(0, 4, [1, 2], [1])


def test_attached_counts_go_with_the_next_token_all_to_all_only():
    tokens = [torch.zeros(2, 3), torch.zeros(2, 3)]
    counts = torch.tensor([3, 1], dtype=torch.int64)
    routing_counts.attach([TAG, 0, 1, 4, 2, 2])
    assert routing_counts.small_ints(Collective.ALL_REDUCE, [counts]) == [[3, 1]]  # drop_tokens=False's MAX
    assert routing_counts.small_ints(Collective.ALL_GATHER, [counts]) == [[3, 1]]
    assert routing_counts.small_ints(Collective.ALL_TO_ALL, [counts]) == [[3, 1]]  # counts of its own
    assert routing_counts.small_ints(Collective.ALL_TO_ALL, tokens, read=False) is None
    assert routing_counts.small_ints(Collective.ALL_TO_ALL, tokens) == [[TAG, 0, 1, 4, 2, 2]]
    assert routing_counts.small_ints(Collective.ALL_TO_ALL, tokens) is None  # once: the combine carries none


def test_deepspeed_expert_parallel_groups_are_sampled_by_ep_folding():
    """World 32, EP 8 (DeepSpeed's labels, :mod:`integrations.deepspeed_compat`): a seed's EP group
    contributes ``ep_sample`` positions; the expert-data-parallel groups span replicas."""
    groups = [(list(range(32)), "default_pg")]
    groups += [(list(range(g, g + 8)), "DEEPSPEED_EXPERT_PARALLEL") for g in range(0, 32, 8)]
    groups += [(list(range(p, 32, 8)), "DEEPSPEED_EXPERT_DATA_PARALLEL") for p in range(8)]
    assert routing_counts.is_ep_proper("DEEPSPEED_EXPERT_PARALLEL")
    assert not routing_counts.is_expert_parallel("DEEPSPEED_EXPERT_DATA_PARALLEL")
    p = plan(groups, [9], 32, ["DATA_PARALLEL", "default_pg"], ep_sample=2)
    assert p.ep_positions == [1, 5] and p.captured == [9, 13]
    assert plan(groups, [9], 32, ["DATA_PARALLEL", "default_pg"], ep_sample=None).captured == list(range(8, 16))


def _a2a(rank, unit, seq, values, group=1):
    return {"rank": rank, "idx": seq, "unit": unit, "kind": "collective", "op": "all_to_all_single",
            "group": group, "seq": seq, "peer": -1, "dtype": "float32", "shape": [4, 16, 8],
            "nbytes": 4 * 16 * 8 * 4, "tensor_key": None,
            "extra": json.dumps({"kind": "all_to_all", "ints": [values]} if values else {"kind": "all_to_all"})}


GATES = {  # rank -> (exp_counts, routed) of layer 0, capacity 6, EP 2 of 2 experts
    0: ([8, 2], [6, 2]),
    1: ([5, 5], [5, 5]),
}


def _rows():
    rows = []
    for unit in range(2):
        for r, (pre, routed) in GATES.items():
            rows.append(_a2a(r, unit, 2 * unit, encode(0, 6, pre, routed)))
            rows.append(_a2a(r, unit, 2 * unit + 1, None))  # the combine: no counts
    return rows


def test_dispatches_found_and_aggregated_with_dropped_tokens():
    found = find_dispatches(_rows(), {1: (0, 1)})
    assert [(d["unit"], d["seq"], d["layer"]) for d in found["dispatches"]] == [(0, 0, 0), (1, 2, 0)]
    assert found["dispatches"][0]["counts"] == {0: [6, 2], 1: [5, 5]}
    assert found["dispatches"][0]["verified"]
    stats = aggregate(found, _rows())
    assert stats["overall"]["tokens_per_expert"] == [22, 14] and stats["overall"]["dropped_tokens"] == 4
    # EP rank 0 holds expert 0: 6 + 5 tokens per step, EP rank 1 expert 1: 2 + 5
    assert stats["overall"]["tokens_per_ep_rank"] == {"0": 22, "1": 14}
    assert stats["per_rank"]["0"]["dropped_tokens"] == [2, 2] and stats["dispatches_verified"] == 2
    assert stats["overall"]["a2a_bytes"] == 8 * 4 * 16 * 8 * 4


def test_a_gate_over_capacity_is_not_verified_and_a_missing_member_is_skipped():
    bad = [_a2a(0, 0, 0, encode(0, 4, [8, 2], [6, 2])), _a2a(1, 0, 0, encode(0, 4, [5, 5], [4, 4]))]
    assert not find_dispatches(bad, {1: (0, 1)})["dispatches"][0]["verified"]
    alone = find_dispatches([_a2a(0, 0, 0, encode(0, 6, [8, 2], [6, 2]))], {1: (0, 1)})
    assert alone["dispatches"] == [] and "not every member" in alone["notes"][0]

    def complete(members, present):  # an EP-folded capture: rank 1 routes twice what the captured rank 0 does
        return {m: present.get(m, [2 * n for n in present[0]]) for m in members}

    folded = find_dispatches([_a2a(0, 0, 0, encode(0, 6, [8, 2], [6, 2]))], {1: (0, 1)}, complete=complete)
    [d] = folded["dispatches"]
    # rank 0's gate dropped tokens: the derived rank's gate keeps at most the capacity (6) per expert
    assert d["derived"] == [1] and d["pre_drop"][1] == [16, 4] and d["counts"][1] == [6, 4]
    assert d["counts"][0] == [6, 2] and d["verified"]
    dropless = find_dispatches([_a2a(0, 0, 0, encode(0, 8, [8, 2], [8, 2]))], {1: (0, 1)}, complete=complete)
    assert dropless["dispatches"][0]["counts"][1] == [16, 4]  # no captured gate dropped: none is assumed


def test_deepspeed_recipes_get_deepspeeds_detector_by_default():
    ds = ["--deepspeed", "--deepspeed_config", "moe.json"]
    assert registry.choose_moe("megatron", ds) == "deepspeed"
    assert registry.choose_moe("megatron", ["--num-experts", "4"]) == "megatron"
    assert registry.choose_moe(None, ds) is None  # turned off stays off
    assert registry.load("deepspeed", "moe", where="integration.moe").find_dispatches is find_dispatches
