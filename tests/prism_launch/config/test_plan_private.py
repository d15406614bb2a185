"""A plan that carries a secret reaches the ranks through a 0600 file, not the environment."""

import os
import stat

from prism_launch.config.plan import PLAN_VAR, CapturePlan, RankPlan


def test_a_plan_with_the_capture_authkey_is_written_private(tmp_path):
    plan = RankPlan(mode="capture", device="cpu", timeout_s=30.0, local_ranks=(0, 1),
                    capture=CapturePlan(coordinator="/s/coord.sock", authkey="00ff" * 8))
    env = plan.to_env(tmp_path / "logs")
    path = tmp_path / "logs" / "plan.json"
    assert env == {PLAN_VAR: f"@{path}"}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "00ff" * 8 not in env[PLAN_VAR]
    assert RankPlan.from_env(env) == plan
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["plan.json"]  # no temporary file left


def test_a_plan_without_a_secret_stays_inline(tmp_path):
    plan = RankPlan(mode="real", device="cpu", timeout_s=30.0, local_ranks=(0,))
    assert not plan.to_env(tmp_path)[PLAN_VAR].startswith("@")
