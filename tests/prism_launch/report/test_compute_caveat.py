"""A prediction whose compute was measured on another kind of device than the target's says so."""

from prism_launch.report.build import compute_caveat


def test_cpu_spans_on_a_gpu_cluster_are_called_what_they_are():
    pred = {"cluster": "h100_ib", "compute_device": "cpu", "cluster_device": "cuda", "compute_scaled": False}
    said = compute_caveat(pred)
    assert "this machine's CPU as measured, not scaled to h100_ib's GPUs" in said
    assert "only communication is h100_ib's" in said


def test_matching_devices_need_no_caveat():
    assert compute_caveat({"cluster": "cpu_local", "compute_device": "cpu", "cluster_device": "cpu"}) == ""
    assert compute_caveat({"cluster": "h200_ib", "compute_device": "cuda", "cluster_device": "cuda"}) == ""
    assert compute_caveat({"cluster": "h100_ib"}) == ""  # an older report
