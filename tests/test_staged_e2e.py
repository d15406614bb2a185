"""Collectives the coordinator computes — a folded capture's groups with members that do not
run, here the data-parallel gradient reductions of the bundled Megatron-core MoE recipe
(PP2·EP2 at 16 ranks: each stage's two captured expert-parallel ranks share one 8-member
data-parallel group) — pass their contributions and results through shared memory
(``scoll``/``sok``) with the results of the socket path, bit for bit; emulation of the
sandbox rank is bit-identical to the capture."""

import json

import pytest

from tests.conftest import MOE_RECIPE, assert_emulation_bit_identical, capture_each, logged_metrics, rank_lines

BASE = ["--nnodes", "2", "--nproc-per-node", "8", "-r", "3", "device=cpu", "comm.timeout_s=120", "capture.fold=true",
        "capture.payload=exact"]
SANDBOX = 15


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_each(tmp_path_factory, "staged", BASE, {on: f"capture.exchange={on}" for on in ("true", "false")},
                        SANDBOX, MOE_RECIPE)


def test_staged_collectives_give_the_socket_paths_results(captures):
    staged, socket = captures["true"], captures["false"]
    busy = json.loads((staged / "trace" / "capture.json").read_text())["rank_busy_s"]
    assert sorted(map(int, busy)) == [6, 7, 14, 15]
    assert all(b["staged_ops"] > 0 for b in busy.values()), busy
    lags = json.loads((staged / "trace" / "capture.json").read_text())["coordinator_lags"]
    assert lags["handle_scoll"]["longest"].startswith("scoll "), lags  # which op held the coordinator longest
    busy = json.loads((socket / "trace" / "capture.json").read_text())["rank_busy_s"]
    assert all(b["staged_ops"] == 0 for b in busy.values()), busy
    for rank in (6, 7, 14, 15):
        a, b = logged_metrics(rank_lines(staged / "logs", rank)), logged_metrics(rank_lines(socket / "logs", rank))
        assert len(a) >= 3 and a == b, rank  # exact float equality


def test_emulation_of_a_staged_capture_is_bit_identical(captures, tmp_path):
    assert_emulation_bit_identical(BASE, captures["true"], SANDBOX, MOE_RECIPE, tmp_path)
