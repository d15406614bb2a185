"""A folded capture's data-parallel gradient reductions over groups of more than 64 members
with two captured members each (the bundled Megatron-core MoE recipe, PP2·EP2 at 160 ranks:
each stage's two captured expert-parallel ranks share one 80-member data-parallel group) are
summed by those members from each other's staged contributions (``capture.fold_exchange``)
with the coordinator's bits: every captured rank logs what it logs when the coordinator sums
them, and emulation of the sandbox rank from that trace (the results the coordinator computed
for the trace, after the members had theirs) is bit-identical."""

import json

import pytest

from tests.conftest import MOE_RECIPE, assert_emulation_bit_identical, capture_each, logged_metrics, rank_lines

BASE = ["--nnodes", "20", "--nproc-per-node", "8", "-r", "3", "device=cpu", "comm.timeout_s=120", "capture.fold=true",
        "capture.payload=exact"]
SANDBOX = 159
CAPTURED = (78, 79, 158, 159)


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_each(tmp_path_factory, "fold-exchange", BASE,
                        {on: f"capture.fold_exchange={on}" for on in ("true", "false")}, SANDBOX, MOE_RECIPE,
                        timeout=600)


def _busy(d):
    return json.loads((d / "trace" / "capture.json").read_text())["rank_busy_s"]


def test_members_sum_the_folded_reductions_with_the_coordinators_bits(captures):
    on, off = captures["true"], captures["false"]
    busy = _busy(on)
    assert sorted(map(int, busy)) == list(CAPTURED)
    assert all(b["folded_exchanged_ops"] >= 3 and b["staged_ops"] == 0 for b in busy.values()), busy
    busy = _busy(off)
    assert all(b["folded_exchanged_ops"] == 0 and b["staged_ops"] >= 3 for b in busy.values()), busy
    for rank in CAPTURED:
        a, b = logged_metrics(rank_lines(on / "logs", rank)), logged_metrics(rank_lines(off / "logs", rank))
        assert len(a) >= 3 and a == b, rank  # exact float equality


def test_emulation_of_a_fold_exchanged_capture_is_bit_identical(captures, tmp_path):
    assert_emulation_bit_identical(BASE, captures["true"], SANDBOX, MOE_RECIPE, tmp_path)
