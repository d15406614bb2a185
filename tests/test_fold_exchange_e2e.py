"""A folded capture's data-parallel gradient reductions over groups of more than 64 members
with two captured members each (the bundled Megatron-core MoE recipe, PP2·EP2 at 160 ranks:
each stage's two captured expert-parallel ranks share one 80-member data-parallel group) are
summed by those members from each other's staged contributions (``capture.fold_exchange``)
with the coordinator's bits: every captured rank logs what it logs when the coordinator sums
them, and emulation of the sandbox rank from that trace (the results the coordinator computed
for the trace, after the members had theirs) is bit-identical."""

import json

import pytest

from tests.conftest import EXAMPLES, logged_metrics, rank_lines, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
MOE = ["--pipeline-model-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "2",
       "--moe-aux-loss-coeff", "0.01", "--replicate-data", "--log-all-ranks"]
BASE = ["--nnodes", "20", "--nproc-per-node", "8", "-r", "3", "device=cpu", "comm.timeout_s=120", "capture.fold=true",
        "capture.payload=exact"]
SANDBOX = 159
CAPTURED = (78, 79, 158, 159)


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    out = {}
    for on in ("true", "false"):
        d = tmp_path_factory.mktemp(f"fold-exchange-{on}")
        r = run_prism([*BASE, "--log-dir", d / "logs", "mode=capture", f"capture.fold_exchange={on}",
                       f"sandbox.ranks=[{SANDBOX}]", f"trace.dir={d / 'trace'}", RECIPE, *MOE], cwd=d, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        out[on] = d
    return out


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
    d = captures["true"]
    r = run_prism([*BASE, "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                   f"sandbox.ranks=[{SANDBOX}]", "emulate.strict=true", f"report.dir={tmp_path / 'report'}",
                   RECIPE, *MOE], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    emu = logged_metrics(rank_lines(tmp_path / "logs", SANDBOX))
    assert len(emu) >= 3 and emu == logged_metrics(rank_lines(d / "logs", SANDBOX))
    assert json.loads((tmp_path / "report" / "report.json").read_text())["ranks"][str(SANDBOX)]["divergences"] == []
