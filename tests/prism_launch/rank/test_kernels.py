"""A calibration slice rank's profiled first steady step (:mod:`prism_launch.rank.kernels`), on CPU:
the profiler runs from the end of step 1 to the end of step 2 and lists torch's ops by their own time."""

import pytest
import torch

from prism_launch.rank.kernels import PROFILED_STEP, StepKernels


def test_the_first_steady_step_is_listed_by_op_and_the_warm_up_and_later_steps_are_not():
    assert PROFILED_STEP == 2
    k = StepKernels("cpu")
    k.start()
    b = torch.randn(64, 64)
    for _ in range(20):
        b = b.tanh() + 1  # warm-up step: adds and tanh only, no matmul
    k.on_step()
    assert k.result is None  # the warm-up step is not profiled
    a = torch.randn(256, 256)
    for _ in range(20):
        a = (a @ a).tanh()
    k.on_step()
    s = k.summary()
    names = dict(s["kernels"])
    assert s["activity"] == "cpu ops" and s["step"] == 2
    assert names.get("aten::mm", 0) > 0 and "aten::add" not in names
    assert s["total_s"] == pytest.approx(sum(names.values()) + s["others_s"])
    for _ in range(5):
        a = a @ a
    k.on_step()
    assert k.summary() == s  # nothing after the profiled step


def test_a_profiler_armed_after_the_warm_up_step_starts_at_once():
    k = StepKernels("cpu")
    k.on_step()  # step 1 ended before the process group existed
    k.start()
    torch.randn(128, 128) @ torch.randn(128, 128)
    k.on_step()
    assert k.summary()["step"] == 2 and dict(k.summary()["kernels"]).get("aten::mm", 0) > 0


def test_a_program_that_ends_early_or_never_starts_says_so():
    k = StepKernels("cpu")
    k.start()
    torch.ones(4).sum()
    assert "ran 0 step(s), fewer than the 2" in k.summary()["error"]
    k = StepKernels("cpu")
    k.start()
    k.on_step()
    torch.ones(4).sum()
    assert "ended before its step 2" in k.summary()["error"]
    assert "created no process group" in StepKernels("cpu").summary()["error"]


def test_a_profiler_that_cannot_start_leaves_an_error_not_a_failure(monkeypatch):
    import torch.profiler

    def broken(*a, **k):
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(torch.profiler, "profile", broken)
    k = StepKernels("cuda")
    k.start()
    k.on_step()
    k.on_step()
    assert k.summary() == {"error": "RuntimeError: CUPTI unavailable"}


def test_a_class_mix_sums_its_members_runs_and_names_the_runs_without_kernels():
    from prism_launch.modes.calibrate import class_mixes
    from prism_launch.predict.shard_classes import ShardClass

    run = {"activity": "cuda kernels", "kernels": [["sm90_xmma_gemm_bf16", 3.0], ["vectorized_elementwise_kernel", 1.0]],
           "others_s": 1.0}
    out = class_mixes([ShardClass((0, 1), 0), ShardClass((2,), 1)],
                      {0: [run], 1: [run, {"error": "RuntimeError: CUPTI unavailable"}], 2: [None]})
    [mix] = out["kernel_mixes"]  # the second class listed nothing
    assert mix["members"] == [0, 1] and mix["kernel_s"] == 10.0
    assert (mix["compute"], mix["memory"], mix["comm"]) == (0.6, 0.2, 0.0)  # others: no class
    assert out["kernel_mix_errors"] == [{"rank": 1, "error": "RuntimeError: CUPTI unavailable"},
                                        {"rank": 2, "error": "no kernels in the rank's summary"}]


def test_a_class_busy_share_is_its_step_kernel_time_over_its_calibrated_steady_step():
    from prism_launch.modes.calibrate import busy_shares, class_mixes
    from prism_launch.predict.shard_classes import ShardClass

    run = {"activity": "cuda kernels", "kernels": [["nvjet_sm90_tst", 0.3], ["nccl_AllReduce", 0.1]], "others_s": 0.0}
    mixes = class_mixes([ShardClass((0,), 0)], {0: [run, run]})["kernel_mixes"]
    assert mixes[0]["step_kernel_s"] == pytest.approx(0.4)  # the mean of the two runs' steps
    rows = [{"rank": 0, "idx": i, "kind": "marker" if i % 2 else "compute", "op": "step",
             "compute_wall_s": 0.0 if i % 2 else 0.5} for i in range(6)]
    busy_shares(mixes, rows)  # steady steps of 0.5 s; 0.3 s of kernels outside communication
    assert mixes[0]["steady_step_s"] == pytest.approx(0.5) and mixes[0]["busy_share"] == pytest.approx(0.6)
