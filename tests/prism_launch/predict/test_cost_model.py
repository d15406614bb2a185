"""Network cost model: formulas against hand-computed values, nccl-tests conventions,
α/β fitting, and the bundled cluster presets."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from prism_launch.predict.cost_model import (
    COLLECTIVE_KINDS,
    COST_MODELS,
    ClusterSpec,
    CostModel,
    LinkSpec,
    NcclCostModel,
    bus_bandwidth_gbps,
    busbw_factor,
    load_cluster,
    make_cost_model,
    nccl_tests_bytes,
    preset_dir,
)
from prism_launch.predict.link_fit import fit_alpha_beta, fit_link

US = 1e-6
GB = 1e9
PRESETS = ("h100_ib", "h200_ib", "a100_ib", "gb200_nvl72", "cpu_local")


def spec(*, nics: int = 8, gpn: int = 8) -> ClusterSpec:
    """Round numbers that are easy to check by hand."""
    return ClusterSpec(
        name="test",
        gpus_per_node=gpn,
        gpu_memory_gib=80.0,
        intra_node=LinkSpec(bandwidth_gbps=360.0, latency_us=0.5),
        inter_node=LinkSpec(bandwidth_gbps=50.0, latency_us=5.0),
        nics_per_node=nics,
        protocol_latency_us=5.0,
    )


@pytest.fixture
def model() -> NcclCostModel:
    return NcclCostModel(spec())


# ---------------------------------------------------------------- formulas


def test_ring_all_reduce_one_node(model):
    n = 360_000_000
    # 5 us launch + 2·7 hops × 0.5 us + 2·7/8 · n / 360 GB/s
    expected = 5 * US + 14 * 0.5 * US + 1.75 * n / (360 * GB)
    est = model.estimate("all_reduce", n, range(8))
    assert est.algorithm == "ring"
    assert est.seconds == pytest.approx(expected, rel=1e-12)
    assert model.collective_time("all_reduce", n, list(range(8))) == pytest.approx(1.762e-3, rel=1e-9)


def test_one_node_kinds(model):
    n = 1_000_000
    p = 4
    ranks = [0, 1, 2, 3]
    bw = 360 * GB
    lat = 5 * US
    assert model.collective_time("all_gather", n, ranks) == pytest.approx(lat + 3 * 0.5 * US + 3 * n / bw)
    assert model.collective_time("reduce_scatter", n, ranks) == pytest.approx(lat + 3 * 0.5 * US + 0.75 * n / bw)
    assert model.collective_time("broadcast", n, ranks) == pytest.approx(lat + 3 * 0.5 * US + n / bw)
    assert model.collective_time("reduce", n, ranks) == pytest.approx(lat + 3 * 0.5 * US + n / bw)
    assert model.collective_time("all_to_all", n, ranks) == pytest.approx(lat + 3 * 0.5 * US + 0.75 * n / bw)
    assert model.collective_time("gather", n, ranks) == pytest.approx(lat + 3 * 0.5 * US + 3 * n / bw)
    assert model.collective_time("scatter", n, ranks) == pytest.approx(lat + 3 * 0.5 * US + 0.75 * n / bw)
    assert p == len(ranks)


@pytest.mark.parametrize("kind", [k for k in COLLECTIVE_KINDS if k != "barrier"])
def test_large_messages_read_back_as_link_busbw(model, kind):
    """On one link, nccl-tests' busbw of a huge op tends to the link's bandwidth."""
    n, p = 1 << 34, 8
    t = model.collective_time(kind, n, range(p))
    assert bus_bandwidth_gbps(kind, n, p, t) == pytest.approx(360.0, rel=1e-3)


def test_two_nodes_one_rank_each_use_the_network(model):
    n = 50_000_000
    # Ring of 2: 2 hops, both leave a node (5 us each); bandwidth = one GPU's NIC share = 8·50/8.
    est = model.estimate("all_reduce", n, [0, 8])
    assert est.algorithm == "ring"
    assert est.bus_bandwidth_gbps == pytest.approx(50.0)
    assert est.seconds == pytest.approx(5 * US + 2 * 5 * US + n / (50 * GB))
    # p2p between the two nodes, and inside one node
    assert model.p2p_time(n, 0, 8) == pytest.approx(5 * US + 5 * US + n / (50 * GB))
    assert model.p2p_time(n, 0, 1) == pytest.approx(5 * US + 0.5 * US + n / (360 * GB))


def test_two_full_nodes_bottleneck(model):
    n = 1 << 30
    est = model.estimate("all_reduce", n, range(24))
    # 8 GPUs per node drive 8 × 50 = 400 GB/s of network: NVLink (360) stays the bottleneck;
    # of 46 hops, 4 cross nodes. On three nodes the tree (0.9 × 360 / 2 = 162 GB/s of buffer)
    # is slower than the ring (360 × 24/46 = 188 GB/s of buffer).
    assert est.algorithm == "ring"
    assert est.bus_bandwidth_gbps == pytest.approx(360.0)
    assert est.latency_s == pytest.approx(5 * US + 42 * 0.5 * US + 4 * 5 * US)
    # With half the NICs, the network (8 × 25 = 200 GB/s) is the bottleneck.
    few_nics = NcclCostModel(spec(nics=4))
    est4 = few_nics.estimate("all_reduce", n, range(24))
    assert est4.bus_bandwidth_gbps == pytest.approx(200.0)
    assert est4.transfer_s == pytest.approx(2 * 23 / 24 * n / (200 * GB))
    # On two nodes each tree is a two-node chain: a node's network carries the buffer once
    # per direction, so the tree beats the ring (NCCL does the same; busbw above the NICs').
    two = model.estimate("all_reduce", n, range(16))
    assert two.algorithm == "tree"
    assert two.transfer_s == pytest.approx(n / (0.9 * 360 * GB))   # 0.9 × min(400, NVLink 360)
    # A group of 2 GPUs per node gets 2 NIC shares.
    est2 = model.estimate("all_gather", n, [0, 1, 8, 9])
    assert est2.bus_bandwidth_gbps == pytest.approx(100.0)
    assert est2.seconds == pytest.approx(5 * US + 2 * 0.5 * US + 1 * 5 * US + 3 * n / (100 * GB))


def test_all_to_all_across_nodes_bounded_by_nics(model):
    n = 16_000_000
    p = 16
    # Each member sends n/16 to each peer: 7 chunks over NVLink, 8 chunks through its
    # 50 GB/s NIC share; the network part dominates.
    intra = 7 / 16 * n / (360 * GB)
    inter = 8 / 16 * n / (50 * GB)
    assert inter > intra
    expected = 5 * US + 7 * 0.5 * US + 8 * 5 * US + inter
    assert model.collective_time("all_to_all", n, range(p)) == pytest.approx(expected)
    # Much slower than the same exchange would be if NVLink reached all 16 GPUs.
    one_domain = NcclCostModel(spec(gpn=16))
    assert model.collective_time("all_to_all", n, range(p)) > 3 * one_domain.collective_time("all_to_all", n, range(p))


def test_gather_root_receives_through_its_nic(model):
    n = 1_000_000
    ranks = [0, 1, 8, 9]  # root 0 shares its node with 1
    expected = 5 * US + 1 * 0.5 * US + 2 * 5 * US + max(1 * n / (360 * GB), 2 * n / (50 * GB))
    assert model.collective_time("gather", n, ranks) == pytest.approx(expected)
    # scatter's nbytes is the root's whole input: each member gets a quarter of it
    assert model.collective_time("scatter", 4 * n, ranks) == pytest.approx(expected)


def test_tree_chosen_for_large_groups_small_messages(model):
    ranks = range(512)  # 64 nodes × 8
    small = model.estimate("all_reduce", 1024, ranks)
    assert small.algorithm == "tree"
    # chain of 8 inside the node + log2(64) = 6 network levels, up and down
    assert small.latency_s == pytest.approx(5 * US + 2 * (7 * 0.5 + 6 * 5.0) * US)
    ring_latency = 5 * US + (2 * 511 - 2 * 63) * 0.5 * US + 2 * 63 * 5 * US
    assert small.seconds < ring_latency
    # each node's links carry the buffer twice per direction, at 0.9 of the ring's bottleneck
    assert small.seconds == pytest.approx(small.latency_s + 1024 / (0.9 * 360 / 2 * GB))
    # a big all_reduce over many nodes goes back to the ring (better bandwidth)
    assert model.algorithm("all_reduce", 8 << 30, range(512)) == "ring"
    # inside one node the tree is never better
    assert model.algorithm("all_reduce", 8, range(8)) == "ring"


def test_trivial_cases_cost_nothing(model):
    for kind in COLLECTIVE_KINDS:
        assert model.collective_time(kind, 1 << 20, [5]) == 0.0
    assert model.collective_time("all_reduce", 0, range(8)) == 0.0
    assert model.p2p_time(1 << 20, 3, 3) == 0.0
    assert model.p2p_time(0, 0, 9) == 0.0


def test_barrier_is_a_tiny_all_reduce(model):
    assert model.collective_time("barrier", 0, range(8)) == pytest.approx(model.collective_time("all_reduce", 4, range(8)))


def test_bad_inputs_are_named(model):
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'.*all_reduce"):
        model.collective_time("allreduce", 8, [0, 1])
    with pytest.raises(ValueError, match="distinct"):
        model.collective_time("all_reduce", 8, [0, 0])
    with pytest.raises(ValueError, match="empty group"):
        model.collective_time("all_reduce", 8, [])
    with pytest.raises(ValueError, match="nbytes"):
        model.collective_time("all_reduce", -1, [0, 1])
    with pytest.raises(ValueError, match="ranks"):
        model.p2p_time(8, -1, 0)


def test_kind_accepts_str_enum(model):
    from nccl_ext.core.ops import Collective

    assert model.collective_time(Collective.ALL_GATHER, 1 << 20, range(8)) == model.collective_time("all_gather", 1 << 20, range(8))


# ---------------------------------------------------------------- conventions and registry


def test_busbw_factors():
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        assert busbw_factor(kind, 8) == pytest.approx(7 / 8)
    for kind in ("broadcast", "reduce"):
        assert busbw_factor(kind, 8) == 1.0
    assert busbw_factor("all_reduce", 1) == 0.0
    assert nccl_tests_bytes("all_gather", 100, 8) == 800
    assert nccl_tests_bytes("reduce_scatter", 800, 8) == 800
    assert nccl_tests_bytes("gather", 100, 8) == 800
    assert nccl_tests_bytes("scatter", 800, 8) == 800
    # busbw of a 1 GB all_reduce over 8 ranks taking 1 ms: algbw 1000 GB/s × 1.75
    assert bus_bandwidth_gbps("all_reduce", 10**9, 8, 1e-3) == pytest.approx(1750.0)


def test_registry():
    assert COST_MODELS["nccl"] is NcclCostModel
    m = make_cost_model("nccl", spec())
    assert isinstance(m, CostModel)
    with pytest.raises(ValueError, match=r"unknown cost model 'astra'.*valid: nccl"):
        make_cost_model("astra", spec())


def test_model_accepts_a_config_node():
    cfg = OmegaConf.create(
        {
            "name": "x",
            "gpus_per_node": 4,
            "gpu_memory_gib": 16,
            "nics_per_node": 1,
            "intra_node": {"bandwidth_gbps": 100, "latency_us": 1},
            "inter_node": {"bandwidth_gbps": 10, "latency_us": 10},
        }
    )
    m = make_cost_model("nccl", cfg)
    assert m.cluster.protocol_latency_us == 7.0  # the default
    assert m.p2p_time(10**9, 0, 4) == pytest.approx(7e-6 + 10e-6 + 10**9 / (2.5 * GB))


def test_spec_validation():
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        LinkSpec(bandwidth_gbps=0.0, latency_us=1.0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        ClusterSpec(
            name="bad",
            gpus_per_node=0,
            gpu_memory_gib=1.0,
            intra_node=LinkSpec(bandwidth_gbps=1.0, latency_us=1.0),
            inter_node=LinkSpec(bandwidth_gbps=1.0, latency_us=1.0),
            nics_per_node=1,
        )


# ---------------------------------------------------------------- fitting


@pytest.mark.parametrize(
    ("kind", "p"),
    [
        ("all_reduce", 8), ("all_reduce", 2), ("all_gather", 4), ("reduce_scatter", 8),
        ("broadcast", 2), ("p2p", 2), ("all_to_all", 4),
    ],
)
def test_fit_recovers_alpha_beta(kind, p):
    truth = NcclCostModel(
        ClusterSpec(
            name="t",
            gpus_per_node=p,
            gpu_memory_gib=1.0,
            intra_node=LinkSpec(bandwidth_gbps=12.5, latency_us=23.0),
            inter_node=LinkSpec(bandwidth_gbps=12.5, latency_us=23.0),
            nics_per_node=1,
            protocol_latency_us=0.0,
        )
    )
    sizes = [1 << s for s in range(10, 25, 2)]
    wobble = [1.004, 0.996, 1.003, 0.997, 1.002, 0.998, 1.001, 0.999]  # ±0.4% measurement noise
    if kind == "p2p":
        samples = [(n, truth.p2p_time(n, 0, 1) * w) for n, w in zip(sizes, wobble)]
    else:
        samples = [(n, truth.collective_time(kind, n, range(p)) * w) for n, w in zip(sizes, wobble)]
    fit = fit_alpha_beta(samples, kind, p)
    assert fit.latency_us == pytest.approx(23.0, rel=0.01)
    assert fit.bandwidth_gbps == pytest.approx(12.5, rel=0.01)


def test_fit_with_protocol_latency_and_joint_kinds():
    link = LinkSpec(bandwidth_gbps=300.0, latency_us=0.7)
    c = ClusterSpec(
        name="t", gpus_per_node=8, gpu_memory_gib=1.0, intra_node=link, inter_node=link,
        nics_per_node=8, protocol_latency_us=6.0,
    )
    m = NcclCostModel(c)
    sizes = [1 << s for s in range(8, 30, 3)]
    samples = [(n, m.collective_time("all_reduce", n, range(8))) for n in sizes]
    fit = fit_alpha_beta(samples, "all_reduce", 8, protocol_latency_us=6.0)
    assert fit.latency_us == pytest.approx(0.7, rel=1e-6)
    assert fit.bandwidth_gbps == pytest.approx(300.0, rel=1e-6)
    joint = fit_link(
        [(k, 8, n, m.collective_time(k, n, range(8))) for k in ("all_reduce", "all_gather", "broadcast") for n in sizes],
        protocol_latency_us=6.0,
    )
    assert joint.latency_us == pytest.approx(0.7, rel=1e-6)
    assert joint.bandwidth_gbps == pytest.approx(300.0, rel=1e-6)


def test_fit_errors():
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_alpha_beta([(1024, 1e-3), (1024, 1.1e-3)], "all_reduce", 2)
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta([(1024, 2e-3), (1 << 20, 1e-3)], "all_reduce", 2)
    with pytest.raises(ValueError, match="p >= 2"):
        fit_alpha_beta([(1024, 1e-3), (2048, 2e-3)], "all_reduce", 1)
    with pytest.raises(ValueError, match="no payload"):
        fit_alpha_beta([(1024, 1e-3), (2048, 2e-3)], "barrier", 2)
    # latency below resolution: α clamps at 0, the bandwidth is still fitted
    fit = fit_alpha_beta([(1000, 1e-6 * 0.9), (10**6, 1e-3)], "p2p", 2)
    assert fit.latency_us == 0.0 and fit.bandwidth_gbps > 0


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_into_cluster_spec(name):
    path = preset_dir() / f"{name}.yaml"
    text = path.read_text()
    assert text.startswith("#"), "a preset starts with a comment saying where its figures come from"
    merged = OmegaConf.merge(OmegaConf.structured(ClusterSpec), OmegaConf.load(path))
    c = OmegaConf.to_object(merged)
    assert isinstance(c, ClusterSpec)
    assert isinstance(c.intra_node, LinkSpec) and isinstance(c.inter_node, LinkSpec)
    assert c.name == name
    assert load_cluster(name) == c
    m = NcclCostModel(c)
    t = m.collective_time("all_reduce", 1 << 20, range(c.gpus_per_node * 2))
    assert 0 < t < 1 and math.isfinite(t)


def test_gpu_presets_are_plausible():
    h100, a100, gb200 = (load_cluster(n) for n in ("h100_ib", "a100_ib", "gb200_nvl72"))
    assert 340 <= h100.intra_node.bandwidth_gbps <= 450
    assert h100.network_share_gbps == pytest.approx(h100.inter_node.bandwidth_gbps)  # one NIC per GPU
    assert 200 <= a100.intra_node.bandwidth_gbps <= 300
    assert a100.inter_node.bandwidth_gbps < 25.0 <= h100.inter_node.bandwidth_gbps
    assert gb200.gpus_per_node == 72 and gb200.intra_node.bandwidth_gbps <= 900
    assert load_cluster("h200_ib").gpu_memory_gib > h100.gpu_memory_gib


def test_load_cluster_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="h100_ib"):
        load_cluster("no_such_cluster")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpus_per_node: eight\n")
    with pytest.raises(ValueError, match="gpus_per_node"):
        load_cluster(bad)


def test_a_kind_with_its_own_measured_cost_uses_it_and_the_others_keep_the_links():
    """``cluster.kinds``: gloo's all_reduce costs several times its broadcast of the same size; a
    kind named there is priced from its own overhead and bandwidth in the same ring formula."""
    from prism_launch.config.cluster import KindCost

    base = NcclCostModel(spec())
    own = NcclCostModel(dataclasses.replace(spec(), kinds={"all_reduce": KindCost(overhead_us=900.0,
                                                                                  bandwidth_gbps=2.0)}))
    n, group = 512 * 1024, [0, 1]
    # ring all_reduce of 2: 2(p-1)/p = 1 buffer over 2 GB/s, plus 900 us, no hop latency
    assert own.collective_time("all_reduce", n, group) == pytest.approx(900 * US + n / (2.0 * GB))
    assert own.flow("all_reduce", n, group).work_s == pytest.approx(n / (2.0 * GB))
    for kind in ("all_gather", "broadcast", "reduce_scatter"):
        assert own.collective_time(kind, n, group) == base.collective_time(kind, n, group)
    assert own.collective_time("barrier", 0, group) == pytest.approx(900 * US + 4 / (2.0 * GB))  # a tiny all_reduce


@pytest.mark.parametrize("kinds,match", [
    ({"allreduce": {"bandwidth_gbps": 1.0}}, "unknown collective kind 'allreduce'"),
    ({"all_reduce": {"bandwidth_gbps": 0.0}}, r"kinds.all_reduce.bandwidth_gbps must be a finite number > 0"),
    ({"all_reduce": {"bandwidth_gbps": 1.0, "overhead_us": -1.0}}, r"kinds.all_reduce.overhead_us must be"),
])
def test_bad_kind_costs_are_named(kinds, match):
    from prism_launch.config.cluster import cluster_from_config

    cfg = OmegaConf.merge(OmegaConf.load(preset_dir() / "cpu_local.yaml"), {"kinds": kinds})
    with pytest.raises(ValueError, match=match):
        cluster_from_config(cfg)


def test_kind_costs_compose_as_an_override():
    from prism_launch.config import compose, resolve

    cfg = resolve(compose(["cluster=cpu_local", "+cluster.kinds={reduce_scatter:{overhead_us:50.0,bandwidth_gbps:1.5}}"]))
    assert cfg.cluster.kinds["reduce_scatter"].overhead_us == 50.0
    m = NcclCostModel(cfg.cluster)
    assert m.collective_time("reduce_scatter", 1 << 20, [0, 1]) == pytest.approx(50 * US + 0.5 * (1 << 20) / (1.5 * GB))
