"""One rank-list format for every message."""

from __future__ import annotations

from nccl_ext.core.ranklist import SHOWN, short_ranks


def test_a_short_list_is_printed_in_full():
    assert short_ranks(range(SHOWN)) == str(list(range(SHOWN)))
    assert short_ranks((3,)) == "[3]"
    assert short_ranks([]) == "[]"


def test_a_long_list_shows_its_stride_its_end_and_its_count():
    text = short_ranks(range(0, 1024, 8))
    assert text == "[0, 8, 16, 24, 32, 40, ..., 1008, 1016] (128 ranks)"
    assert short_ranks(range(SHOWN + 1)).endswith(f"({SHOWN + 1} ranks)")


def test_the_launcher_and_the_layer_print_the_same():
    from nccl_ext.core.pending import short_ranks as pending_short
    from prism_launch.capture.ops_state import describe

    ranks = tuple(range(100))
    assert describe(ranks) == pending_short(ranks) == short_ranks(ranks)
