"""A calibration slice rank's profiled first step (:mod:`prism_launch.rank.kernels`), on CPU: the
profiler stops when the first step ends and lists torch's ops by their own time."""

import pytest
import torch

from prism_launch.rank.kernels import StepKernels


def test_the_first_step_is_listed_by_op_and_later_steps_are_not():
    k = StepKernels("cpu")
    k.start()
    a = torch.randn(256, 256)
    for _ in range(20):
        a = (a @ a).tanh()
    k.on_step()
    s = k.summary()
    names = dict(s["kernels"])
    assert s["activity"] == "cpu ops" and s["step"] == 1
    assert names.get("aten::mm", 0) > 0 and sum(names.values()) > 0
    assert s["total_s"] == pytest.approx(sum(names.values()) + s["others_s"])
    for _ in range(5):
        a = a @ a
    k.on_step()
    assert k.summary() == s  # nothing after the first step


def test_a_program_that_ends_inside_its_first_step_or_never_starts_says_so():
    k = StepKernels("cpu")
    k.start()
    torch.ones(4).sum()
    assert "ended before its step 1" in k.summary()["error"]
    assert "created no process group" in StepKernels("cpu").summary()["error"]


def test_a_profiler_that_cannot_start_leaves_an_error_not_a_failure(monkeypatch):
    import torch.profiler

    def broken(*a, **k):
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(torch.profiler, "profile", broken)
    k = StepKernels("cuda")
    k.start()
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
