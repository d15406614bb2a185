"""The default cluster is the one the compute spans describe: cpu_local for device=cpu."""

from prism_launch.config.root import compose


def test_device_cpu_defaults_to_the_measured_local_cluster():
    assert compose(["device=cpu"]).cluster.name == "cpu_local"
    assert compose(["device=cpu"]).cluster.device == "cpu"


def test_an_explicit_cluster_or_cuda_keeps_its_preset():
    assert compose(["device=cpu", "cluster=h100_ib"]).cluster.name == "h100_ib"
    assert compose(["device=cuda"]).cluster.name == "h100_ib"
    assert compose(["device=cuda"]).cluster.device == "cuda"


def test_collectives_take_the_cores_on_a_cpu_cluster_unless_told_otherwise():
    import pytest

    from prism_launch.config import resolve

    assert resolve(compose(["device=cpu"])).cluster.comm_on_cores is True
    assert resolve(compose(["device=cuda"])).cluster.comm_on_cores is False
    assert resolve(compose(["device=cpu", "cluster.comm_overlaps_compute=true"])).cluster.comm_on_cores is False
    assert resolve(compose(["device=cuda", "cluster.comm_overlaps_compute=false"])).cluster.comm_on_cores is True
    with pytest.raises(Exception, match="comm_overlaps_compute"):
        resolve(compose(["device=cpu", "cluster.comm_overlaps_compute=sometimes"]))
