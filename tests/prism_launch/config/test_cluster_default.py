"""The default cluster is the one the compute spans describe: cpu_local for device=cpu."""

from prism_launch.config.root import compose


def test_device_cpu_defaults_to_the_measured_local_cluster():
    assert compose(["device=cpu"]).cluster.name == "cpu_local"
    assert compose(["device=cpu"]).cluster.device == "cpu"


def test_an_explicit_cluster_or_cuda_keeps_its_preset():
    assert compose(["device=cpu", "cluster=h100_ib"]).cluster.name == "h100_ib"
    assert compose(["device=cuda"]).cluster.name == "h100_ib"
    assert compose(["device=cuda"]).cluster.device == "cuda"
