"""``emulate.timing=predicted``: virtual ranks arrive at the lag the global replay predicts, so a
sandbox rank waits for a peer the replay says is slower. tests/workers/known_timeline.py fixes
each rank's compute: per step rank 0 (the sandbox) burns 20 ms and all-reduces with rank 1
(30 ms) and rank 2 (25 ms), then sends to rank 1, which burns 15 ms before sending back. So
rank 0 should wait ~10 ms at the all-reduce and ~15 ms for the reply, every step — and with
``emulate.timing=none`` (virtual ranks arrive at once) not at all."""

import json
import statistics

import pytest

from tests.conftest import WORKERS, run_prism

pytestmark = pytest.mark.serial  # wall-clock bounds: run alone (make test)

SCRIPT = WORKERS / "known_timeline.py"
COMMON = ["--nproc-per-node", "3", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60"]
STEPS = 4
LAG_MS = (30.0 - 20.0) + 15.0  # the slowest peer's extra compute before the all-reduce, then rank 1's stage


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    d = tmp_path_factory.mktemp("timing")
    r = run_prism([*COMMON, "mode=capture", f"trace.dir={d / 'trace'}", SCRIPT], cwd=d, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for timing in ("predicted", "none"):
        r = run_prism([*COMMON, "mode=emulate", "sandbox.ranks=[0]", f"emulate.timing={timing}",
                       f"trace.dir={d / 'trace'}", f"report.dir={d / timing}", SCRIPT], cwd=d, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out[timing] = json.loads((d / timing / "report.json").read_text())["ranks"]["0"]
    return out


def _steady_ms(rank: dict) -> float:
    """The median step after the first (warm-up) one, in ms."""
    return 1e3 * statistics.median(rank["step_times_s"][1:])


def test_predicted_timing_makes_the_sandbox_wait_for_its_slower_peers(sandbox):
    waited_ms = 1e3 * sandbox["predicted"]["replay_wait_s"]
    # the burns are CPU time: on a busy machine rank 0's own take longer in wall time and eat into
    # its waits, hence the lower bound at half
    assert waited_ms >= 0.5 * STEPS * LAG_MS, sandbox["predicted"]
    # a lag replayed twice, or recorded wall-clock lags, would pass this bound on a steady step; the
    # first step's lag also carries the peers' warm-up in the capture (first allocations, lazy
    # initialisation), which differs between stacks, so it is left out
    extra = _steady_ms(sandbox["predicted"]) - _steady_ms(sandbox["none"])
    assert extra <= 1.6 * LAG_MS, sandbox


def test_no_timing_means_no_wait(sandbox):
    assert sandbox["none"]["replay_wait_s"] == 0


def test_the_wait_shows_in_the_sandboxs_steps(sandbox):
    assert len(sandbox["predicted"]["step_times_s"]) == STEPS
    assert _steady_ms(sandbox["predicted"]) - _steady_ms(sandbox["none"]) >= 0.5 * LAG_MS, sandbox
