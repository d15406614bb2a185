"""Token counts kept by value in every payload mode (``extra["ints"]``), and the layer of each
dispatch read from the op order: the MoE section needs neither stored tensors nor a flag."""

import json

import torch

from integrations.megatron_moe import LayerOrder, find_dispatches
from nccl_ext.core.ops import Collective
from nccl_ext.core.routing_counts import INTS_MAX_BYTES, small_ints
from prism_launch.report.moe_stats import aggregate
from tests.prism_launch.report.test_moe_stats import GROUPS, _rows_and_tensors


def test_small_integer_contributions_are_kept_by_value_only():
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int64)
    assert small_ints(Collective.ALL_GATHER, [counts]) == [[3, 0, 5, 1]]
    assert small_ints(Collective.ALL_TO_ALL, [counts[:2], counts[2:]]) == [[3, 0], [5, 1]]
    assert small_ints(Collective.ALL_REDUCE, [torch.ones(2, dtype=torch.float32)]) is None   # not counts
    assert small_ints(Collective.BROADCAST, [counts]) is None       # token batches are broadcast, not counts
    assert small_ints(Collective.ALL_GATHER, [torch.zeros(INTS_MAX_BYTES // 8 + 1, dtype=torch.int64)]) is None
    assert small_ints(Collective.ALL_GATHER, [torch.ones(3, dtype=torch.bool)]) is None
    assert small_ints(Collective.ALL_GATHER, [torch.ones(3, dtype=torch.uint8)]) is None  # pickled objects


def _as_ints(rows, tensors):
    """The same trace as a ``payload=none`` capture records it: no tensors, values in extra."""
    out = []
    for row in rows:
        row = dict(row)
        if row.get("tensor_key"):
            extra = json.loads(row["extra"])
            extra["ints"] = [tensors[row["rank"]][row["tensor_key"]].tolist()]
            row["extra"], row["tensor_key"] = json.dumps(extra), None
        out.append(row)
    return out


def test_counts_by_value_give_the_same_statistics_as_stored_tensors():
    rows, tensors = _rows_and_tensors()
    from_tensors = aggregate(find_dispatches(rows, GROUPS, lambda r, k: tensors[r][k], script_args=[]), rows)

    def no_tensor(r, k):
        raise AssertionError(f"read tensor {k} of rank {r}: the counts are in the events")

    lean = _as_ints(rows, tensors)
    by_value = aggregate(find_dispatches(lean, GROUPS, no_tensor, script_args=[]), lean)
    assert by_value is not None and by_value["overall"] == from_tensors["overall"]
    assert by_value["per_step"] == from_tensors["per_step"] and by_value["dispatches_verified"] == 4


def _dispatch_rows(pattern):
    """A rank's op sequence: ``g`` a count gather then its token all-to-all, ``a`` another
    all-to-all, ``p`` a pipeline send, ``m`` a step marker."""
    rows, idx = [], 0
    gather = {"kind": "collective", "dtype": "int64", "shape": [4],
              "extra": json.dumps({"kind": "all_gather", "ints": [[1, 2, 3, 4]]})}
    a2a = {"kind": "collective", "dtype": "float32", "shape": [3, 8], "extra": json.dumps({"kind": "all_to_all"})}
    for c in pattern:
        for row in {"g": [gather, a2a], "a": [a2a], "p": [{"kind": "p2p", "extra": None}],
                    "m": [{"kind": "marker", "extra": None}]}[c]:
            rows.append({**row, "rank": 0, "idx": idx})
            idx += 1
    return rows


def _layers(pattern):
    rows = _dispatch_rows(pattern)
    order = LayerOrder(rows)
    return [order.layer_of(r) for r in rows if r.get("dtype") == "int64"]


def test_layer_of_each_dispatch_from_the_op_order():
    # no pipeline: F(L0 L1) B(4 all-to-alls) F(L0 L1) ...: a backward pass between forwards
    assert _layers("gagaaaaagagaaaaam" "gagaaaaagagaaaaa") == [0, 1, 0, 1, 0, 1, 0, 1]
    # a pipeline stage: forwards separated by sends (1F1B warm-up, then F B alternating)
    assert _layers("gagapgagapaaaapgagap") == [0, 1, 0, 1, 0, 1]
    # one MoE layer per stage and no pipeline: every gap alike, every dispatch is layer 0
    assert _layers("gaaagaaagaaa") == [0, 0, 0]
