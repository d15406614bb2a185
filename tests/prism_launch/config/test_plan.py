"""The rank plan survives its one trip through the environment, whole and typed."""

from __future__ import annotations

import pytest

from prism_launch.config.plan import PLAN_VAR, CapturePlan, EmulatePlan, PrefetchPlan, RankPlan


def _emulating(sandbox: tuple[int, ...]) -> RankPlan:
    pf = PrefetchPlan(mode="stream", pool_bytes=512 << 20, grow=True, reserve_bytes=4 << 30, threads=4,
                      host_tier_bytes=16 << 30)
    em = EmulatePlan(trace_dir="/t", sandbox=sandbox, timing="predicted", time_scale=1.0, strict=False, check=True,
                     data_path="device", prefetch=pf, pruned=False, ring_backend="gloo", ring_tags=True, assistant=True,
                     window=32, store="127.0.0.1:1234", schedule_file="/r/s.json",
                     summary_files={r: f"/r/sandbox/rank{r}.json" for r in sandbox}, assistant_summary="/r/a.json")
    return RankPlan(mode="emulate", device="cuda", compat=("integrations.cpu_compat",), timeout_s=30.0,
                    local_ranks=sandbox, memory_limit_bytes=80 << 30, emulate=em)


def test_round_trip_keeps_every_field_and_type():
    plan = _emulating((5, 1000))
    env = plan.to_env()
    assert list(env) == [PLAN_VAR]
    back = RankPlan.from_env(env)
    assert back == plan
    assert isinstance(back.emulate.sandbox, tuple) and isinstance(back.emulate.prefetch, PrefetchPlan)
    assert back.summary_file(1000).name == "rank1000.json"  # int keys survive JSON's string keys
    assert (back.device_slot(5), back.device_slot(1000), back.device_slot(None)) == (0, 1, 2)


def test_a_long_plan_spills_to_a_file(tmp_path):
    plan = RankPlan(mode="capture", device="cpu", timeout_s=30.0, local_ranks=tuple(range(20000)),
                    capture=CapturePlan(coordinator="/s", authkey="ab", captured=tuple(range(20000))))
    env = plan.to_env(tmp_path)
    assert env[PLAN_VAR] == f"@{tmp_path / 'plan.json'}"
    assert RankPlan.from_env(env) == plan
    with pytest.raises(ValueError, match="too long for the environment"):
        plan.to_env(None)


def test_a_process_without_a_plan_is_told_how_to_start():
    with pytest.raises(RuntimeError, match="not started by prism-launch"):
        RankPlan.from_env({})
