"""Throughput and MFU of a prediction, and the warning outside the plausible MFU band."""

import pytest

from prism_launch.config.cluster import GpuSpec, load_cluster
from prism_launch.predict.throughput import Counted, step_flops, throughput, mfu_warning
from prism_launch.report.build import throughput_lines

H100 = load_cluster("h100_ib").gpu


def test_throughput_and_mfu_of_an_iteration():
    t = throughput(iteration_s=0.5, flops=8 * 400e12 * 0.5, tokens_per_step=1_000_000, world=8, gpu=H100)
    assert t["tokens_per_s"] == pytest.approx(2e6)
    assert t["tokens_per_s_per_gpu"] == pytest.approx(2.5e5)
    assert t["model_tflops_per_gpu"] == pytest.approx(400)
    assert t["mfu"] == pytest.approx(400 / 989)


def test_unknown_tokens_still_give_tflops_and_mfu_and_no_peak_no_mfu():
    t = throughput(1.0, 8e12, None, 8, H100)
    assert t["tokens_per_s"] is None and t["model_tflops_per_gpu"] == pytest.approx(1.0)
    assert t["mfu"] == pytest.approx(1 / 989)
    assert throughput(1.0, 8e12, None, 8, GpuSpec(name="cpu"))["mfu"] is None


def test_a_folded_world_counts_each_rank_as_its_stand_in():
    c = Counted(per_rank={0: 10, 1: 20}, embedded_tokens=None, step=2, incomplete=[])
    assert step_flops(c, 4, {"rep": [0, 1, 0, 1]}) == 60
    assert step_flops(c, 4, None) is None  # two of four ranks counted, no fold: unknown


def _pred(mfu, **kw):
    return {"cluster": "h100_ib", "cluster_device": "cuda", "compute_device": "cuda", "compute_source": "calibrated",
            "cluster_gpu": H100.name, "gpu_scaling": {"scaled": True}, "throughput": {"mfu": mfu}, **kw}


def test_mfu_inside_the_band_has_no_warning():
    assert mfu_warning(_pred(0.4)) == ""


def test_low_mfu_names_cpu_spans_and_uncalibrated_compute():
    said = mfu_warning(_pred(0.038, compute_device="cpu", compute_source="bare (cpu)",
                             gpu_scaling={"scaled": False, "why": "measured on a CPU"}))
    assert "3.80% is below the plausible 10%-75%" in said
    assert "MFU 5.5e-05% is below" in mfu_warning(_pred(5.5e-7))  # CPU-time spans: tiny, still readable
    assert "CPU time" in said and "uncalibrated" in said and "h100_ib" in said


def test_unscaled_gpu_compute_and_high_mfu_are_named():
    low = mfu_warning(_pred(0.05, gpu_scaling={"scaled": False, "why": "no datasheet peaks known for NVIDIA L4"}))
    assert "not scaled to the target GPU (no datasheet peaks known for NVIDIA L4)" in low
    assert "recompute" in mfu_warning(_pred(0.9))


def test_cpu_clusters_have_no_band():
    assert mfu_warning(_pred(0.001, cluster_device="cpu")) == ""


def test_the_report_lines_carry_throughput_factors_and_warning():
    pred = _pred(0.05, mfu_warning="MFU 5.0% is below ...",
                 gpu_scaling={"scaled": True, "measuring_device": "NVIDIA H200", "target_gpu": H100.name,
                              "compute_factor": 1.0, "memory_factor": 1.433, "mean_factor": 1.2,
                              "compute_fraction": 0.5, "memory_fraction": 0.5, "comm_fraction": 0.0,
                              "mix_source": "counted FLOPs"})
    pred["throughput"] = {**throughput(0.5, 8e14, 4096, 8, H100), "tokens_source": "args", "flops_source": "counted"}
    text = "\n".join(throughput_lines(pred))
    assert "tokens/s/GPU" in text and "TFLOP/s per GPU" in text and "MFU 20.22%" in text
    assert "memory-bound x1.433" in text and "50% FLOP-bound / 50% memory-bound" in text
    assert "warning" in text


def test_low_mfu_of_a_host_bound_program_names_the_host():
    """The 8B job's local layers at TP8: the GPU busy ~60% of the calibrated compute, MFU 7%."""
    said = mfu_warning(_pred(0.07, gpu_scaling={"scaled": True, "busy_share": 0.6}))
    assert "busy only 60% of the calibrated compute" in said and "host-bound" in said
    assert "host-bound" not in mfu_warning(_pred(0.07, gpu_scaling={"scaled": True, "busy_share": 0.95}))
    assert "host-bound" not in mfu_warning(_pred(0.07))  # no busy share measured: nothing said
