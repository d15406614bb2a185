"""FLOPs of grouped-query attention: torch's attention formulas assert one head count for query,
key and value; the counting rank widens key/value heads to the query's instead of failing the
program, and an op it still cannot count is named, and its rank's count not used."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from prism_launch.rank.flops import count_op

aten = torch.ops.aten


def _meta(*shape):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


def _strict(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """torch 2.11's attention formula: one head count for query, key and value, or an assertion."""
    b, h, s, d = query_shape
    if tuple(key_shape) != tuple(query_shape) or tuple(value_shape) != tuple(query_shape):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    return 4 * b * h * s * s * d


FLASH = aten._scaled_dot_product_flash_attention


def _counter(strict: bool = True):
    return FlopCounterMode(display=False, custom_mapping={FLASH: _strict} if strict else {})


def test_grouped_query_attention_counted_as_ungrouped():
    b, hq, hkv, s, d = 1, 32, 8, 512, 128
    q, k, v = _meta(b, hq, s, d), _meta(b, hkv, s, d), _meta(b, hkv, s, d)
    out = (_meta(b, hq, s, d),)
    grouped, uncounted = _counter(), {}
    with pytest.raises(AssertionError):  # the formula refuses grouped heads
        grouped._count_flops(FLASH, out, (q, k, v), {})
    count_op(grouped, FLASH.default, out, (q, k, v), {}, uncounted)
    assert uncounted == {}
    assert grouped.get_total_flops() == 4 * b * hq * s * s * d
    # where torch's own formula takes grouped heads (2.13), widening gives what it counts
    native = _counter(strict=False)
    count_op(native, FLASH.default, out, (q, k, v), {}, {})
    assert native.get_total_flops() == grouped.get_total_flops()


def test_op_still_refused_is_named_not_raised():
    counter, uncounted = _counter(), {}
    q, k = _meta(1, 32, 64, 16), _meta(1, 12, 64, 16)  # 12 does not divide 32: no grouping to widen
    count_op(counter, FLASH.default, (_meta(1, 32, 64, 16),), (q, k, k), {}, uncounted)
    assert list(uncounted) == ["aten._scaled_dot_product_flash_attention"]
    assert "AssertionError" in uncounted["aten._scaled_dot_product_flash_attention"]
    assert counter.get_total_flops() == 0


def test_rank_with_uncounted_ops_not_used(tmp_path):
    from prism_launch.predict.throughput import counted

    class Reader:
        def json_files(self):
            return ["memory.json"]

        def read_json(self, name):
            return {"0": {"model_flops": {"flops": 10, "complete": True, "step": 2,
                                          "uncounted_ops": {"aten.x": "AssertionError: shapes"}}},
                    "1": {"model_flops": {"flops": 12, "complete": True, "step": 2}}}

    from prism_launch.trace import TraceLayout

    assert TraceLayout.MEMORY == "memory.json"
    c = counted(Reader())
    assert c.per_rank == {1: 12}
    assert "aten.x" in c.not_counted and "AssertionError" in c.not_counted
