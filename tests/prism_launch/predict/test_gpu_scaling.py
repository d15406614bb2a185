"""Compute spans scaled from the measuring GPU to the cluster's by their kernel mix."""

import pytest

from prism_launch.config.cluster import GpuSpec, load_cluster
from prism_launch.predict.gpu_scaling import (
    KernelMix, classify_kernel, gpu_of, mix_from_flops, mix_from_kernels, scale_span, scaling_factors,
)
from prism_launch.predict.throughput import Counted, scale_rows

H100 = load_cluster("h100_ib").gpu
H200 = load_cluster("h200_ib").gpu
A100 = load_cluster("a100_ib").gpu


def test_a_pure_matmul_span_scales_by_the_flop_rate_ratio():
    mix = KernelMix(compute=1.0, memory=0.0)
    assert scale_span(1.0, mix, A100, H100) == pytest.approx(312 / 989)
    assert scale_span(2.0, mix, H200, H100) == pytest.approx(2.0)  # same die, same compute


def test_a_pure_memory_span_scales_by_the_bandwidth_ratio():
    mix = KernelMix(compute=0.0, memory=1.0)
    assert scale_span(1.0, mix, H200, H100) == pytest.approx(4.8 / 3.35)  # H100's HBM is slower
    assert scale_span(1.0, mix, A100, H100) == pytest.approx(2.039 / 3.35)


def test_communication_is_left_to_the_network_model_and_the_rest_kept():
    mix = KernelMix(compute=0.5, memory=0.2, comm=0.2)  # 0.1 of no known class
    want = 0.5 * 312 / 989 + 0.2 * 2.039 / 3.35 + 0.1
    assert scale_span(1.0, mix, A100, H100) == pytest.approx(want)


def test_the_same_gpu_has_factor_one_except_for_communication():
    s = scaling_factors(H100, GpuSpec(name="H100 80GB HBM3"), KernelMix(compute=0.3, memory=0.7))
    assert (s.factor, s.compute_factor, s.memory_factor) == (1.0, 1.0, 1.0)
    assert scale_span(1.0, KernelMix(compute=0.6, memory=0.2, comm=0.2), H100, H100) == pytest.approx(0.8)


def test_an_unknown_peak_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="hbm_bandwidth_tbps"):
        scale_span(1.0, KernelMix(compute=1.0, memory=0.0), H100, GpuSpec(name="X", peak_bf16_tflops=100.0))


def test_kernel_names_classify_by_the_rule_table():
    assert classify_kernel("sm90_xmma_gemm_bf16bf16_bf16f32") == "compute"
    assert classify_kernel("flash_fwd_kernel") == "compute"
    assert classify_kernel("void at::native::vectorized_elementwise_kernel<4, ...>") == "memory"
    assert classify_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "comm"
    assert classify_kernel("some_custom_kernel") is None
    # names a Hopper GPU lists under torch 2.11: cuBLASLt's nvjet GEMMs, Inductor's kernels
    assert classify_kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN") == "compute"
    assert classify_kernel("nvjet_hsh_192x128_64x5_1x2_h_bz_coopA_NTN") == "compute"
    assert classify_kernel("triton_tem_fused_addmm_0") == "compute"
    assert classify_kernel("triton_poi_fused_add_mul_3") == "memory"
    assert classify_kernel("triton_red_fused_native_layer_norm_1") == "memory"
    assert classify_kernel("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>") == "memory"
    assert classify_kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "comm"
    mix = mix_from_kernels([("ampere_bf16_gemm", 3.0), ("layer_norm_kernel", 1.0), ("ncclKernel", 1.0)])
    assert (mix.compute, mix.memory, mix.comm, mix.source) == (0.6, 0.2, 0.2, "profiler")


def test_the_default_mix_is_the_counted_flops_share_of_the_peak():
    mix = mix_from_flops(flops=0.5 * 989e12 * 0.01, seconds=0.01, measured=H100)
    assert mix.compute == pytest.approx(0.5) and mix.memory == pytest.approx(0.5)
    assert mix_from_flops(None, 1.0, H100).compute == 1.0  # stated default: FLOP-bound
    assert "FLOP-bound" in mix_from_flops(None, 1.0, H100).source


def test_the_measuring_gpu_is_found_by_name_among_presets():
    assert gpu_of({"kind": "cuda", "name": "NVIDIA H200"}, H100) == H200
    assert gpu_of({"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}, H100) is H100
    assert gpu_of({"kind": "cpu", "name": "Xeon"}, H100) is None
    assert gpu_of({"kind": "cuda", "name": "NVIDIA L4"}, H100) is None


def _rows():
    return [{"rank": 0, "kind": "collective", "compute_cpu_s": 0.2, "compute_wall_s": 0.1},
            {"rank": 0, "kind": "marker", "compute_cpu_s": 0.0, "compute_wall_s": 0.0}]


def test_rows_are_scaled_per_rank_and_the_report_says_how():
    rows = _rows()
    # rank 0 did 0.05 s of its 0.1 s at H200 peak: half FLOP-bound, half memory-bound
    c = Counted(per_rank={0: int(0.05 * 989e12)}, embedded_tokens=None, step=2, incomplete=[])
    s = scale_rows(rows, {"kind": "cuda", "name": "NVIDIA H200"}, H100, c, "wall")
    assert s["scaled"] and s["mix_source"] == "counted FLOPs"
    assert s["compute_fraction"] == pytest.approx(0.5)
    assert rows[0]["compute_wall_s"] == pytest.approx(0.1 * (0.5 + 0.5 * 4.8 / 3.35))


def test_cpu_or_unrecorded_devices_are_not_scaled_and_say_why():
    c = Counted(per_rank={}, embedded_tokens=None, step=None, incomplete=[])
    rows = _rows()
    assert "CPU" in scale_rows(rows, {"kind": "cpu", "name": "Xeon"}, H100, c, "cpu")["why"]
    assert "does not record" in scale_rows(rows, None, H100, c, "cpu")["why"]
    assert rows[0]["compute_cpu_s"] == 0.2


def test_a_calibrated_shard_class_kernel_mix_scales_its_members_over_the_counted_flops():
    """The calibrated manifest's ``kernel_mixes`` (``calibrate.kernel_mix``) reach every member of
    the class and win over the counted-FLOPs default."""
    from types import SimpleNamespace

    from prism_launch.predict.prediction import kernel_mixes

    reader = SimpleNamespace(manifest=SimpleNamespace(extra={"kernel_mixes": [
        {"members": [0, 3], "compute": 0.25, "memory": 0.75, "comm": 0.0, "activity": "cuda kernels"}]}))
    mixes = kernel_mixes(reader)
    assert sorted(mixes) == [0, 3] and mixes[3].memory == 0.75 and "profiler (cuda kernels" in mixes[0].source
    assert kernel_mixes(SimpleNamespace(manifest=SimpleNamespace(extra={}))) == {}
    rows = _rows()
    c = Counted(per_rank={0: int(0.05 * 989e12)}, embedded_tokens=None, step=2, incomplete=[])
    s = scale_rows(rows, {"kind": "cuda", "name": "NVIDIA H200"}, H100, c, "wall", mixes)
    assert s["mix_source"].startswith("profiler") and s["memory_fraction"] == pytest.approx(0.75)
    assert rows[0]["compute_wall_s"] == pytest.approx(0.1 * (0.25 + 0.75 * 4.8 / 3.35))


def test_a_class_busy_share_leaves_the_gpu_idle_time_unscaled():
    """A host-bound class (its GPU busy 60% of the calibrated compute): its kernel shares are of
    that 60%; the 40% the GPU waited on its host is kept as measured on another GPU."""
    from types import SimpleNamespace

    from prism_launch.predict.prediction import kernel_mixes

    reader = SimpleNamespace(manifest=SimpleNamespace(extra={"kernel_mixes": [
        {"members": [0], "compute": 0.25, "memory": 0.75, "comm": 0.0, "activity": "cuda kernels", "busy_share": 0.6}]}))
    mix = kernel_mixes(reader)[0]
    assert (mix.compute, mix.memory, mix.other) == pytest.approx((0.15, 0.45, 0.4))
    assert "GPU busy 60%" in mix.source
    s = scale_rows(_rows(), {"kind": "cuda", "name": "NVIDIA H200"}, H100, Counted(per_rank={}, embedded_tokens=None,
                                                                                  step=2, incomplete=[]), "wall", {0: mix})
    assert s["other_fraction"] == pytest.approx(0.4) and s["busy_share"] == pytest.approx(0.6)
    # H200 -> H100: memory-bound time x(4.8/3.35); FLOP-bound x1; the idle 40% x1
    assert s["mean_factor"] == pytest.approx(0.15 + 0.45 * H200.hbm_bandwidth_tbps / H100.hbm_bandwidth_tbps + 0.4)
    # with communication kernels (20% of the kernel time) the busy share counts the others only:
    # kernels of any class are then 0.6 / 0.8 of the span
    reader.manifest.extra["kernel_mixes"][0].update(compute=0.2, memory=0.6, comm=0.2)
    mix = kernel_mixes(reader)[0]
    assert (mix.compute, mix.memory, mix.comm, mix.other) == pytest.approx((0.15, 0.45, 0.15, 0.25))
