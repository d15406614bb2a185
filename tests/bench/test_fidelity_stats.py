"""The fidelity harnesses' own logic (bench/fidelity_stats.py), without running a job: errors,
spreads and the self-check that turns a missing value or a missed goal into a failure."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from fidelity_stats import Pair, failures, machine, summarize, table  # noqa: E402


def test_errors_means_and_spread_of_interleaved_pairs():
    pairs = [Pair(0.100, 0.104, {0: 1000, 1: 2000}, {0: 1000, 1: 2010}),
             Pair(0.100, 0.098, {0: 1000, 1: 2000}, {0: 1001, 1: 2000})]
    assert pairs[0].time_error_pct == pytest.approx(4.0) and pairs[1].time_error_pct == pytest.approx(-2.0)
    assert pairs[0].memory_error_pct == pytest.approx(0.5)
    row = summarize("dense", pairs, time_goal_pct=5.0, memory_goal_pct=1.0)
    assert row["error_mean_pct"] == pytest.approx(1.0) and row["error_abs_max_pct"] == pytest.approx(4.0)
    assert row["error_sd_pct"] == pytest.approx(math.sqrt(18))
    assert row["real_ms"] == pytest.approx(100.0) and row["predicted_ms"] == pytest.approx(101.0)
    assert row["memory_error_max_pct"] == pytest.approx(0.5)
    assert failures([row]) == []
    assert "dense" in table([row]) and "±5%" in table([row])


def test_a_missed_goal_or_a_missing_value_fails():
    far = summarize("far", [Pair(0.1, 0.2, {0: 10}, {0: 10})], time_goal_pct=5.0)
    assert any("beyond the goal" in f for f in failures([far]))
    no_memory = summarize("nomem", [Pair(0.1, 0.1, {0: 10}, {})])  # no rank in common: nan, not 0
    assert any("memory_error_max_pct" in f for f in failures([no_memory]))
    nan_time = summarize("nan", [Pair(0.1, float("nan"), {0: 1}, {0: 1})])
    assert any("predicted_ms" in f for f in failures([nan_time]))
    assert any("no pairs" in f for f in failures([summarize("none", [])]))
    mem = summarize("mem", [Pair(0.1, 0.1, {0: 1000}, {0: 1002})], memory_goal_pct=0.1)
    assert any("peak-memory error" in f for f in failures([mem]))


def test_the_machine_is_named():
    m = machine()
    assert "cores" in m and "torch" in m


def test_gpu_harness_cases_arguments_and_log_parsing():
    import gpu_fidelity as g

    cs = g.cases()
    assert len(cs) == 24 and {"dense-s512-m1", "moe-s1024-m4", *g.DEFAULT_CASES} <= set(cs)
    big = g.job_args(cs["1.6b-moe-s2048-m1"], iters=6)
    assert big[big.index("--hidden-size") + 1] == "4096" and big[big.index("--num-layers") + 1] == "8"
    assert big[big.index("--ffn-hidden-size") + 1] == "4096" and big.count("--hidden-size") == 1
    args = g.job_args(cs["moe-s1024-m4"], iters=6, dp=8)
    assert args[args.index("--global-batch-size") + 1] == str(g.MICRO_BATCH * 4 * 8)
    assert args[args.index("--seq-length") + 1] == "1024" and "--num-experts" in args
    assert "--num-experts" not in g.job_args(cs["dense-s512-m1"], iters=6)
    log = "\n".join(f" [2026-12-01 10:00:0{i}] iteration        {i}/       4 | consumed samples: {i * 4:12d} | "
                    f"elapsed time per iteration (ms): {t} | learning rate: 1.0E-04 |"
                    for i, t in ((1, 900.0), (2, 101.0), (3, 99.0), (4, 100.0)))
    assert g.iteration_s(log) == pytest.approx(0.100)  # the first iteration left out
    with pytest.raises(ValueError):
        g.iteration_s("no iterations here")
    ok = {"case": "c", "dp_world": 8, "dp_predicted_ms": 110.0, "predicted_ms": 100.0}
    assert g.dp_failures([ok]) == [] and g.dp_failures([{**ok, "dp_predicted_ms": 90.0}])


def test_absolute_goals_do_not_let_errors_of_both_signs_cancel_and_the_real_spread_is_printed():
    pairs = [Pair(0.100, 0.108, {0: 1}, {0: 1}), Pair(0.100, 0.092, {0: 1}, {0: 1}), Pair(0.120, 0.120, {0: 1}, {0: 1})]
    row = summarize("zero3", pairs, time_goal_pct=5.0, time_max_goal_pct=10.0, absolute=True, memory_goal_pct=1.0)
    assert row["error_mean_pct"] == pytest.approx(0.0) and row["error_abs_mean_pct"] == pytest.approx(16 / 3)
    assert any("mean |iteration-time error|" in f for f in failures([row]))
    assert failures([{**row, "goal_absolute": False}]) == []  # the signed mean alone would pass
    assert row["real_range_pct"] == pytest.approx(100 * 0.02 / (0.32 / 3))
    assert row["real_spread_pct"] == pytest.approx(100 * 0.011547 / (0.32 / 3), rel=1e-3)
    wide = summarize("tp", [Pair(0.1, 0.111, {0: 1}, {0: 1}), Pair(0.1, 0.1, {0: 1}, {0: 1})], time_goal_pct=5.0,
                     time_max_goal_pct=10.0, absolute=True)
    assert [f for f in failures([wide]) if "largest |iteration-time error| 11.00%" in f]
    text = table([row])
    assert "real spread" in text and "|±5%,10%" in text


def test_gloo_kinds_fit_their_own_latency_and_bandwidth():
    """bench/gloo_overhead.py's per-kind fit (netbench's) recovers each kind's op time from times
    made by the cost model's own hop and byte counts, and writes them as one ``cluster.kinds`` override."""
    from gloo_overhead import _terms, fit_kinds, kinds_override

    from prism_launch.config.cluster import KindCost

    truth = {"all_reduce": (750.0, 2.5), "broadcast": (150.0, 3.0), "all_gather": (500.0, 0.7)}  # µs/hop, GB/s
    sizes = (1 << 10, 16 << 10, 512 << 10, 2 << 20)
    measured = {(k, n): _terms(k, n, 2)[0] * lat * 1e-6 + _terms(k, n, 2)[1] / bw
                for k, (lat, bw) in truth.items() for n in sizes}
    measured[("p2p", 1024)] = 1e-4  # not a collective kind: left to the links
    got = fit_kinds(measured, 2)
    assert set(got) == set(truth)
    for k, (lat, bw) in truth.items():
        assert (got[k].latency_us, got[k].bandwidth_gbps) == pytest.approx((lat, bw), rel=1e-3)
    assert fit_kinds({("all_reduce", 1024): 1e-3}, 2) == {}  # one size: no fit
    over = kinds_override({"broadcast": KindCost(latency_us=150.0, bandwidth_gbps=3.0)})
    assert over == "+cluster.kinds={broadcast:{latency_us:150.0,bandwidth_gbps:3.0}}"
