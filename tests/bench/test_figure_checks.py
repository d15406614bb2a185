"""Each bench's figure check (bench/figures.py and the ``figures`` function of every bench that
uses it): a figure not measured or missing its goal gives a non-zero exit code and is printed
as MISSING / MISSED, never as a default — and complete, passing figures give 0."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import capture_memory  # noqa: E402
import capture_scale  # noqa: E402
import coordinator_load  # noqa: E402
import deepspeed_fidelity  # noqa: E402
import fidelity_stats  # noqa: E402
import fold_exchange  # noqa: E402
import gpu_exact  # noqa: E402
import gpu_lean  # noqa: E402
import gpu_park  # noqa: E402
import gpu_upstream  # noqa: E402
import replay_scale  # noqa: E402
import scale  # noqa: E402
import trace_size  # noqa: E402
from figures import IS_TRUE, NONE_LISTED, Figure, at_most, exit_code, problems, table  # noqa: E402


def test_a_missing_value_prints_missing_and_fails():
    for absent in (None, float("nan"), []):
        f = [Figure("ok", 1.0), Figure("absent", absent)]
        assert exit_code(f) == 1 and "MISSING" in table(f) and "absent" in problems(f)[0]
    assert exit_code([Figure("zero is a value", 0), Figure("no OOM", [], NONE_LISTED)]) == 0


def test_a_missed_goal_is_marked_and_fails():
    f = [Figure("max running", 3, at_most(2)), Figure("same", False, IS_TRUE)]
    assert exit_code(f) == 1 and table(f).count("MISSED") == 2 and len(problems(f)) == 2
    assert exit_code([Figure("max running", 2, at_most(2)), Figure("same", True, IS_TRUE)]) == 0
    assert exit_code([Figure("not comparable", "n/a", at_most(2))]) == 1


def _scale(**change):
    row = {"n": 8, "slots": 2, "wall_s": 10.0, "capture_s": 9.0, "resumes": 0, "max_running": 2, "peak_mb": 300.0,
           "trace_mb": 1.5, **change}
    return capture_scale.figures([row], same=True, check=8)


def _ds(**change):
    row = {"recipe": "zero1", "torchrun_s": 5.0, "capture_s": 6.0, "max_rel_diff_torchrun_vs_capture": 0.0,
           "emulate": {"[5]": (True, 3.0)}, **change}
    return deepspeed_fidelity.figures([row])


def _upstream(**change):
    res = {"capture_s": 100.0, "trace_bytes": 10,
           "default": {"predicted_iteration_ms": 50.0, "losses_match_capture": True, "divergences": 0,
                       "sandbox_peak_bytes": 1},
           "asked_2_per_slice": {"predicted_iteration_ms": 51.0, "losses_match_capture": True, "divergences": 0,
                                 "sandbox_peak_bytes": 1, "notice": ["ranks would share a device: cut to 1"]},
           "ratio_asked_2_per_slice": 1.02}
    for k, v in change.items():
        if "." in k:
            label, key = k.split(".")
            res[label] = {**res[label], key: v}
        else:
            res[k] = v
    return gpu_upstream.figures(res)


def _lean(**change):
    res = {"trace_bytes": 2**20, "captured_ranks": 32, "trace_bytes_per_rank_step": 1024.0, "capture_s": 100.0,
           "capture_wall_s_per_iteration": 30.0, "capture_megatron_ms_per_iteration": [900.0, 800.0],
           "admission": {"max_admitted": 4, "measured_peaks": {"0": 2**30}}, "launcher_peak_rss_bytes": 2**30,
           "emulate_s": 50.0, "sandbox_peak_bytes": 2**30, "emulate_megatron_ms_per_iteration": [700.0],
           "predicted_iteration_ms": 1200.0, "max_rank_peak_bytes": 2**31, "oom_ranks": [], **change}
    return gpu_lean.figures(res)


def _exact(**change):
    res = {"job": "dense", "trace_bytes": 10**9, "tensor_bytes": 10**8, "full_tensor_bytes": 10**10, "capture_s": 100.0,
           "capture_ms_per_iteration": [900.0, 800.0, 800.0], "emulate_ms_per_iteration": [100.0, 90.0, 90.0],
           "losses_match_capture": True, "divergence_counts": {"tolerance": 1}, "sandbox_peak_bytes": 5,
           "predicted_iteration_ms": 80.0, "emulate_s": 60.0, **change}
    return gpu_exact.figures(res)


def _coord(**change):
    def stats(exchange):
        return {"wall_s": 10.0, "coordinator_busy_s": {"receive": 1.0, "reply": 0.5, "pump": 0.2},
                "rank_busy_s": {"0": {"send": 0.1, "stage": 0.2, "staged_ops": 3}},
                "coordinator_lags": {"pump": {"max_s": 0.004, "over_10ms": 0}}}
    s = {"true": stats("true"), "false": stats("false")}
    losses = {"true": ["1.0", "0.9"], "false": ["1.0", "0.9"]}
    if "receive" in change:
        s["true"]["coordinator_busy_s"].pop("receive")
    if "losses" in change:
        losses = change["losses"]
    return coordinator_load.figures(s, losses)


def _fold(**change):
    def run(on):
        return {"seconds": 30.0, "steps_ms": [900.0, 400.0, 410.0], "folded_exchanged": 12 if on else 0, "staged": 5,
                "compute_s": 0.1, "scoll_max_s": 0.002, "dp_blocked_s": 0.5, "metrics": {0: [("loss", "1.0")]}}
    res = {True: run(True), False: run(False)}
    for k, v in change.items():
        res[True][k] = v
    return fold_exchange.figures(res)


def _scale_rows(**change):
    row = {"layout": "TP2", "world": 1024, "captured": 2, "capture_s": 5.0, "init_s": 0.2, "new_group_calls": 3,
           "rss_before_init_mb": 300.0, "init_growth_mb": 5.0, "hwm_mb": 400.0, "step_ms": 12.0, "predicted_ms": 11.0,
           **change}
    return scale.figures([row], 11.5, want_real=True)


def _memory(**change):
    rows = [{"payload": p, "steps": n, "peak_rss": 500 * 2**20, "tensor_bytes": 2**20, "stored": 2**20, "pending": 0,
             "trace_bytes": 2**21, "wall_s": 10.0} for p in ("full", "none") for n in (4, 32)]
    rows[1].update(change)  # full at 32 steps
    return capture_memory.figures(rows, 0.25)


def _sizes(**change):
    rows = {p: {"payload": p, "tensor_bytes": b, "trace_bytes": b + 1000, "wall_s": 5.0, "ranks": 4}
            for p, b in (("full", 10**7), ("exact", 2 * 10**6), ("none", 0))}
    rows["exact"].update(change)
    return trace_size.figures(rows)


CASES = {  # bench: (complete figures, a missing one, a failing one — {} where the bench states no goal)
    "capture_scale": (_scale, {"peak_mb": None}, {"max_running": 3}),
    "deepspeed_fidelity": (_ds, {"max_rel_diff_torchrun_vs_capture": None}, {"emulate": {"[5]": (False, 3.0)}}),
    "gpu_upstream": (_upstream, {"default.losses_match_capture": None}, {"ratio_asked_2_per_slice": 2.5}),
    "gpu_lean": (_lean, {"capture_megatron_ms_per_iteration": []}, {}),  # no goal: its figures are reported
    "gpu_exact": (_exact, {"full_tensor_bytes": None}, {"divergence_counts": {"value": 2}}),
    "coordinator_load": (_coord, {"receive": None}, {"losses": {"true": ["1.0"], "false": ["1.1"]}}),
    "fold_exchange": (_fold, {"steps_ms": [900.0]}, {"folded_exchanged": 0}),
    "scale": (_scale_rows, {"hwm_mb": None}, {}),
    "capture_memory": (_memory, {"peak_rss": None}, {"peak_rss": 700 * 2**20}),
    "trace_size": (_sizes, {"tensor_bytes": None}, {"tensor_bytes": 2 * 10**7}),
    "replay_scale": (lambda **c: replay_scale.figures(c.get("predicted", 0.0305), 0.030, 1e5),
                     {"predicted": float("nan")}, {"predicted": 0.040}),
}


@pytest.mark.parametrize("bench", list(CASES))
def test_each_bench_fails_on_a_missing_or_a_failing_figure(bench):
    build, missing, failing = CASES[bench]
    assert exit_code(build()) == 0, problems(build())
    assert exit_code(build(**missing)) != 0 and "MISSING" in table(build(**missing))
    if failing:  # a bench with goals: missing one fails too
        assert exit_code(build(**failing)) != 0 and "MISSED" in table(build(**failing))


def test_gpu_park_fails_when_parking_was_not_needed_or_a_ballast_broke():
    base = {"stats": {"wall_s": 5.0}, "lines": {0: ["R0 x ballast_intact True"], 1: ["R1 y ballast_intact True"]}}
    parked = {"stats": {"wall_s": 9.0, "resumes": 4, "parking": {"checkpoints": 4}}, "lines": base["lines"]}
    assert exit_code(gpu_park.figures(30.0, 2, 19.0, base, parked)) == 0
    assert exit_code(gpu_park.figures(80.0, 2, 19.0, base, parked)) != 0  # 38 GiB fit on an 80 GiB card
    assert exit_code(gpu_park.figures(None, 2, 19.0, base, parked)) != 0
    broken = {**parked, "lines": {0: ["R0 x ballast_intact False"], 1: base["lines"][1]}}
    assert exit_code(gpu_park.figures(30.0, 2, 19.0, {**base, "lines": broken["lines"]}, broken)) != 0
    silent = {**parked, "lines": {0: [], 1: []}}
    assert "MISSING" in table(gpu_park.figures(30.0, 2, 19.0, {**base, "lines": silent["lines"]}, silent))
    assert exit_code(gpu_park.figures(30.0, 2, 19.0, base, {**parked, "stats": {"wall_s": 9.0}})) != 0


def test_gpu_exact_reports_no_share_of_a_full_trace_it_did_not_measure():
    names = [f.name for f in _exact(full_tensor_bytes=None)]
    assert "dense exact / full tensors" in names
    assert not any("full" in f.name for f in gpu_exact.figures({"job": "dense", "tensor_bytes": 1}))
    assert not hasattr(gpu_exact, "FULL_TENSOR_BYTES") and all(len(v) == 3 for v in gpu_exact.JOBS.values())


def test_deepspeed_fidelity_compares_values_or_says_none_were():
    assert deepspeed_fidelity.max_rel_diff([[]], [[]]) is None
    assert deepspeed_fidelity.max_rel_diff([[{"loss": 2.0}]], [[{"loss": 1.0}]]) == pytest.approx(1.0)


def test_coordinator_load_says_no_pump_ran_rather_than_missing_or_zero_seconds():
    stats = {"false": {"wall_s": 1.0, "coordinator_busy_s": {"receive": 1.0, "reply": 0.5, "pump": 0.0},
                       "rank_busy_s": {"0": {}}, "coordinator_lags": {}}}
    figs = {f.name: f for f in coordinator_load.figures(stats, {"false": ["1.0"]})}
    assert figs["capture.exchange=false longest pump s"].shown() == "no pump ran"
    stats["false"]["coordinator_busy_s"]["pump"] = 0.3  # pumps ran but no lag was noted: missing
    assert coordinator_load.figures(stats, {"false": ["1.0"]})[-3].missing


def test_the_fidelity_table_prints_missing_never_nan():
    row = fidelity_stats.summarize("case", [fidelity_stats.Pair(0.1, 0.1, {0: 10}, {})])
    text = fidelity_stats.table([row])
    assert "MISSING" in text and "nan" not in text.lower()


def test_gpu_lean_reports_an_oom_verdict_only_when_the_report_gives_one():
    assert {f.name: f.shown() for f in _lean(oom_ranks=[])}["OOM ranks at the cluster's memory"] == "none"
    assert exit_code(_lean(oom_ranks=None)) != 0 and exit_code(_lean(oom_ranks=[3, 7])) == 0


def _report_8b(iteration_s, source="calibrated (6 shard classes)", fused=(1.7, 0.45, 2.6, 0.3), busy=0.62):
    import gpu_predict8b

    step = {"compute_s": 0.1, "collective_waits_s": {"TENSOR_MODEL_PARALLEL_GROUP": 0.02, "DATA_PARALLEL_GROUP": 0.01},
            "p2p_waits_s": 0.03, "waits_s": 0.06}
    rep = {"predicted": {"iteration_time_s": iteration_s, "iteration_times_s": [1.0, iteration_s or 0.0],
                         "compute_source": source, "gpu_scaling": {"scaled": True, "busy_share": busy},
                         "throughput": {"tokens_per_s_per_gpu": 1000.0,
                                                                  "model_tflops_per_gpu": 200.0, "mfu": 0.2,
                                                                  "peak_bf16_tflops": 989.0}},
           "ranks": {"8191": {"sandbox": True, "step": step}},
           "fused": {"factor": fused[0], "iteration_time_s": fused[1], "factor_graphed": 3.0,
                     "iteration_time_graphed_s": 0.39, "iteration_time_host_kept_up_s": 0.5,
                     "kernel_factor_graphed": fused[2], "iteration_time_fused_kept_up_s": fused[3]}}
    return gpu_predict8b.summarize(rep, gpu_predict8b.Shape(), 8191)[0]


def test_the_8b_prediction_and_its_fused_layer_what_if_must_fall_in_their_bands():
    assert exit_code(_report_8b(0.75)) == 0
    assert exit_code(_report_8b(0.25)) == 1            # local layers: outside 610-920 ms
    assert exit_code(_report_8b(0.95)) == 1
    assert exit_code(_report_8b(0.75, fused=(1.7, 0.45, 2.6, 0.45))) == 1  # judged what-if outside 170-380 ms
    assert exit_code(_report_8b(0.75, fused=(1.7, 0.45, None, None))) == 1  # kernel factor not measured
    assert exit_code(_report_8b(0.75, fused=(None, None, 2.6, 0.3))) == 1  # eager what-if missing
    assert exit_code(_report_8b(None)) == 1            # not predicted
    assert exit_code(_report_8b(0.75, source="cpu thread")) == 1
    assert exit_code(_report_8b(0.75, busy=None)) == 1  # no kernel profile: the busy share is missing
    figs = {f.name: f.value for f in _report_8b(0.75)}
    assert figs["GPU busy share of the calibrated compute %"] == pytest.approx(62.0)
    assert figs["sandbox exposed TP ms"] == pytest.approx(20.0) and figs["sandbox exposed DP ms"] == pytest.approx(10.0)
    assert figs["predicted iteration ms with fused layers, host kept up (host gaps removed, compute / kernel factor)"] \
        == pytest.approx(300.0)
    assert figs["predicted iteration ms with fused layers, eager launches (compute / factor)"] == pytest.approx(450.0)


def test_the_8b_what_ifs_replay_the_settings_their_factors_name():
    import gpu_predict8b

    got = dict((k, v) for v, k in gpu_predict8b.what_ifs({"factor": 2.0, "factor_graphed": None,
                                                          "kernel_factor_graphed": 2.5}))
    assert got == {"iteration_time_host_kept_up_s": ["replay.host_gaps=removed"],
                   "iteration_time_s": ["replay.compute_speedup=2"],
                   "iteration_time_fused_kept_up_s": ["replay.host_gaps=removed", "replay.compute_speedup=2.5"]}


def test_the_8b_first_principles_estimate_is_megatrons_count():
    import gpu_predict8b

    sh = gpu_predict8b.Shape()
    assert sh.flops_per_token() / 1e9 == pytest.approx(51.47, abs=0.01) and sh.micro_batches == 8
    lo, hi = gpu_predict8b.first_principles(sh)["total"]
    assert 0.17 <= lo < hi <= 0.38


def _moe_section(aux=1.02):
    return {"num_experts": 8, "ep_sizes": [8], "dispatches": 96, "dispatches_verified": 96, "ranks_counted": 1024,
            "dropped_source": "dropless", "fold": {"captured_ranks": 16, "world_size": 1024},
            "overall": {"tokens_per_expert": [10, 20, 30, 40, 10, 20, 30, 40], "expert_imbalance": 1.6,
                        "expert_cv": 0.45, "ep_rank_imbalance": 1.6, "ep_rank_cv": 0.45, "dropped_tokens": 0,
                        "aux_loss": aux, "aux_loss_name": "load_balancing_loss"},
            "per_step": [{"step": 0, "expert_imbalance": 1.6, "expert_cv": 0.45, "ep_rank_imbalance": 1.6,
                          "dropped_tokens": 0}],
            "effect": {"a2a_wait_s": {"most_loaded": 0.004, "mean": 0.002}}}


def _report_moe(captured=16, steps=3, source="calibrated by shard class", moe="ok", aux=1.02):
    import gpu_moe_rows

    rep = {"predicted": {"iteration_time_s": 0.9, "iteration_times_s": [0.9] * steps, "compute_source": source,
                         "throughput": {"tokens_per_s_per_gpu": 9000.0, "peak_bf16_tflops": 989.0}},
           "moe": _moe_section(aux) if moe == "ok" else moe}
    return gpu_moe_rows.summarize(rep, gpu_moe_rows.ROWS["mixtral"], 3, captured)[0]


def test_the_moe_rows_need_routing_statistics_calibration_steps_and_few_captured_ranks():
    assert exit_code(_report_moe()) == 0
    assert exit_code(_report_moe(captured=40)) == 1     # over the row's bound
    assert exit_code(_report_moe(steps=2)) == 1          # fewer than 3 steps
    assert exit_code(_report_moe(source="capture device time")) == 1
    assert exit_code(_report_moe(moe=None)) == 1         # no moe section
    assert exit_code(_report_moe(moe={"error": "not every member recorded"})) == 1
    assert exit_code(_report_moe(aux=None)) == 1         # no aux loss recorded
    figs = {f.name: f.value for f in _report_moe()}
    assert figs["most loaded EP rank's all-to-all waits ms"] == pytest.approx(4.0)


def test_the_moe_rows_are_the_issues_layouts():
    import gpu_moe_rows

    mix, qwen = gpu_moe_rows.ROWS["mixtral"], gpu_moe_rows.ROWS["qwen3"]
    for row in (mix, qwen):
        row.check()
        args = row.args(3)
        assert args[args.index("--moe-token-dispatcher-type") + 1] == "alltoall" and "--mock-data" in args
        assert args[args.index("--global-batch-size") + 1] == str(8 * row.dp)
    assert (mix.pp, mix.ep, mix.dp, mix.global_batch) == (4, 8, 256, 2048)
    assert (qwen.pp, qwen.ep, qwen.dp, qwen.global_batch, qwen.max_captured) == (8, 32, 128, 1024, 64)
    # Megatron's formula: Mixtral ~ 6 x 12.9B active parameters per token, plus attention and logits
    per_token = gpu_moe_rows.flops_per_step(mix, 3) / mix.global_batch / mix.seq
    assert 75e9 < per_token < 90e9
