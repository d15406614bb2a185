"""The coordinator's lag record names the longest of each kind of message."""

from prism_launch.capture.ops_state import Lags, op_label
from nccl_ext.core.protocol import Coll, XRead


def test_the_longest_is_named_and_slow_ones_counted():
    lags = Lags()
    lags.note("handle_coll", 0.002, "coll all_reduce seq 1 on group g")
    lags.note("handle_coll", 0.3, "coll all_gather seq 7 on group h")
    lags.note("handle_coll", 0.05, "coll broadcast seq 8 on group h")
    lags.note("pump", 0.02)
    d = lags.to_dict()
    assert d["handle_coll"] == {"max_s": 0.3, "over_10ms": 2, "over_10ms_s": 0.35,
                                "longest": "coll all_gather seq 7 on group h"}
    assert d["pump"] == {"max_s": 0.02, "over_10ms": 1, "over_10ms_s": 0.02}


def test_op_label_names_call_group_and_sequence():
    header = Coll(3, "tp:0,1", 12, "all_reduce", "allreduce", "sum", None, True, 0, 0.0, 0.0, 0.0)
    assert op_label(header) == "coll all_reduce seq 12 on group tp:0,1"
    assert op_label(XRead(3)) == "xread"
