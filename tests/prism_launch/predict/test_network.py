"""Links shared by overlapping transfers, NCCL's size curve, algorithm choice and the fabric."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from prism_launch.config.cluster import ClusterSpec, FabricSpec, LinkSpec
from prism_launch.predict.cost_model import GB, NcclCostModel, load_cluster
from prism_launch.predict.network import Flow, FlowNetwork
from prism_launch.predict.simulate import MARK, RECV, SEND, WAIT, Graph, replay

MIB = 1 << 20


def spec(**kw) -> ClusterSpec:
    base = dict(name="t", gpus_per_node=8, gpu_memory_gib=80.0, nics_per_node=8, protocol_latency_us=5.0,
                intra_node=LinkSpec(bandwidth_gbps=360.0, latency_us=0.5),
                inter_node=LinkSpec(bandwidth_gbps=50.0, latency_us=5.0))
    base.update(kw)
    return ClusterSpec(**base)


# --------------------------------------------------------------------------- flows


def test_two_flows_on_one_link_share_it_and_finish_as_if_sequential():
    net = FlowNetwork()
    one = Flow(latency_s=0.0, work_s=1.0, links=(("nic", 1.0),))
    net.add(0.0, one, "a")
    net.add(0.0, one, "b")
    ends = [net.pop(), net.pop()]
    # each gets half the link: both end at 2 s, the time the two take back to back
    assert [t for t, _ in ends] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert net.pop() is None and net.contended == 2


def test_late_flow_slows_the_running_one_only_while_they_overlap():
    net = FlowNetwork()
    net.add(0.0, Flow(latency_s=0.0, work_s=1.0, links=(("nic", 1.0),)), "a")
    net.add(0.5, Flow(latency_s=0.0, work_s=1.0, links=(("nic", 1.0),)), "b")
    (ta, a), (tb, b) = net.pop(), net.pop()
    # a: 0.5 s alone, then half rate for its last 0.5 s of work -> 1.5; b: 0.5 s of work at
    # half rate until 1.5, then the rest alone -> 2.0 (the link never idles: 2 s of work)
    assert (a, ta, b, tb) == ("a", pytest.approx(1.5), "b", pytest.approx(2.0))


def test_disjoint_links_do_not_slow_each_other():
    net = FlowNetwork()
    net.add(0.0, Flow(latency_s=0.1, work_s=1.0, links=((1, 1.0), (2, 1.0))), "a")
    net.add(0.0, Flow(latency_s=0.1, work_s=1.0, links=((3, 1.0), (4, 1.0))), "b")
    assert sorted(t for t, _ in (net.pop(), net.pop())) == [pytest.approx(1.1), pytest.approx(1.1)]
    assert net.contended == 0


def _sends(pairs, nbytes):
    """Rank ``src`` issues every send of ``pairs`` at once, then waits for them all."""
    g: dict[int, list] = {}
    for n, (src, dst) in enumerate(pairs):
        key = (0, src, dst, 0, n)
        g.setdefault(src, []).append((SEND, 0.0, key, nbytes))
        g.setdefault(dst, []).extend([(RECV, 0.0, key, None), (WAIT, 0.0, ("r", key), None)])
    for n, (src, dst) in enumerate(pairs):
        g[src].append((WAIT, 0.0, ("s", (0, src, dst, 0, n)), None))
    for evs in g.values():
        evs.append((MARK, 0.0, 0, None))
    return Graph(g, 32)


def test_replay_two_sends_through_one_nic_take_twice_as_long():
    model = NcclCostModel(spec())
    n = 256 * MIB
    alone = model.estimate_p2p(n, 0, 8)
    # rank 0 sends to two other nodes at once: both leave through its NIC
    rep = replay(_sends([(0, 8), (0, 16)], n), model)
    assert (rep.flows, rep.slowed_flows) == (2, 2)
    assert rep.iteration_time_s == pytest.approx(alone.latency_s + 2 * alone.transfer_s, rel=1e-9)
    assert rep.iteration_time_s > alone.seconds * 1.9
    # one send alone: the same time as priced alone
    assert replay(_sends([(0, 8)], n), model).iteration_time_s == pytest.approx(alone.seconds)


def test_replay_sends_on_disjoint_nics_do_not_interfere():
    model = NcclCostModel(spec())
    n = 256 * MIB
    rep = replay(_sends([(0, 8), (1, 9)], n), model)   # GPUs 0 and 1 use rails 0 and 1
    assert (rep.flows, rep.slowed_flows) == (2, 0)
    assert rep.iteration_time_s == pytest.approx(model.p2p_time(n, 0, 8))


# --------------------------------------------------------------------------- size curve


@pytest.mark.parametrize("preset", ["h100_ib", "h200_ib", "a100_ib"])
def test_bandwidth_curve_is_monotone_and_reaches_the_plateau(preset):
    c = load_cluster(preset)
    model = NcclCostModel(c)
    sizes = [1 << k for k in range(10, 42)]
    bws = [model.busbw_curve(c.intra_node, s) for s in sizes]
    assert all(b2 > b1 for b1, b2 in zip(bws, bws[1:]))
    assert bws[0] < 0.05 * c.intra_node.bandwidth_gbps
    assert bws[-1] == pytest.approx(c.intra_node.bandwidth_gbps, rel=0.01)
    # the collective's time follows it: 4x the bytes costs less than 4x the time below the plateau
    t1, t4 = (model.collective_time("all_gather", s, range(8)) for s in (MIB, 4 * MIB))
    assert t4 < 4 * t1


def test_curve_key_is_what_one_member_streams_per_dependent_step():
    from prism_launch.predict.cost_model import curve_key

    n = 64 * MIB
    assert curve_key("ring", "reduce_scatter", n, 16) == n / 16          # size / p per ring step
    assert curve_key("ring", "all_gather", n, 16) == n                    # size is the gathered p x n
    assert curve_key("nvls", "all_reduce", n, 8) == n / 8
    assert curve_key("nvls_tree", "all_reduce", n, 80, 8) == n / 8       # the node's k slices
    assert curve_key("pipeline", "broadcast", n, 16) == n
    assert curve_key("direct", "all_to_all", n, 16) == n / 16             # one peer's chunk
    assert curve_key("direct_net", "all_to_all", n, 16, 8) == n / 2       # the member's off-node bytes


def test_ring_at_a_fixed_size_slows_as_nodes_are_added_all_to_all_does_not_pay_per_step():
    c = spec(inter_node=LinkSpec(bandwidth_gbps=50.0, latency_us=5.0, half_size_mib=4.0, curve_exponent=0.7))
    model = NcclCostModel(c)
    size = 4 << 30

    def busbw(kind, nodes, n=size):
        p = 8 * nodes
        return model.estimate(kind, n, range(p)).bus_bandwidth_gbps

    rs = [busbw("reduce_scatter", nodes) for nodes in (4, 16, 64, 256)]
    assert all(b2 < b1 for b1, b2 in zip(rs, rs[1:]))      # per-step chunk size / p shrinks
    assert rs[0] > 0.9 * 360.0 and rs[-1] < 0.5 * rs[0]   # 360: the NVLink bound of 8 x 50
    # one network share per GPU for rings and direct transfers: both plateau at it
    assert model.estimate("all_to_all", 64 << 30, range(80)).bus_bandwidth_gbps == pytest.approx(50.0, rel=0.02)
    # at a mid size the member's off-node sends stream back to back: high on the curve,
    # where the ring's 80 dependent steps of size / 80 are not
    mid = 128 * MIB
    a2a = model.estimate("all_to_all", mid, range(80)).bus_bandwidth_gbps / 50.0
    ring = model.estimate("all_gather", mid // 80, range(80)).bus_bandwidth_gbps / 360.0
    assert a2a > 0.9 > 0.5 > ring


# --------------------------------------------------------------------------- algorithm choice


def test_all_reduce_picks_nvls_tree_collnet_or_ring_as_nccl_would():
    big, small = 4 << 30, 4096
    plain = NcclCostModel(spec())
    nvls = NcclCostModel(spec(nvls=True, nvls_bandwidth_gbps=270.0))
    sharp = NcclCostModel(spec(sharp=True))
    # one node: NVLS where the switch reduces (faster than the ring's 360 busbw = 206 algbw), else ring
    assert nvls.algorithm("all_reduce", big, range(8)) == "nvls"
    assert plain.algorithm("all_reduce", big, range(8)) == "ring"
    # many nodes, small message: the tree's log-depth latency wins; NVLS-tree with NVLS
    assert plain.algorithm("all_reduce", small, range(512)) == "tree"
    assert nvls.algorithm("all_reduce", small, range(512)) == "nvls_tree"
    # many nodes, huge message: the ring's bandwidth wins
    assert plain.algorithm("all_reduce", 64 << 30, range(512)) == "ring"
    # in-network reduction: each node moves the buffer once whatever the node count
    assert sharp.algorithm("all_reduce", big, range(512)) == "collnet"
    # forcing an algorithm the group cannot use is an error naming the ones it can
    with pytest.raises(ValueError, match="available: ring"):
        plain.estimate("all_reduce", big, range(8), algorithm="nvls")


# --------------------------------------------------------------------------- fabric


def test_oversubscription_slows_only_inter_leaf_traffic():
    def model(over):
        return NcclCostModel(spec(fabric=FabricSpec(nodes_per_leaf=4, oversubscription=over)))

    flat, thin = model(1.0), model(8.0)
    n = 1 << 30
    across = range(64)       # 8 nodes: two leaves
    within = range(32)       # 4 nodes: one leaf
    assert thin.collective_time("all_to_all", n, across) > 1.5 * flat.collective_time("all_to_all", n, across)
    assert thin.collective_time("all_to_all", n, within) == flat.collective_time("all_to_all", n, within)
    # node 0 -> node 4 (another leaf): one NIC's stream against uplinks of 4 NICs / 8
    assert thin.p2p_time(n, 0, 32) > flat.p2p_time(n, 0, 32)
    assert model(4.0).p2p_time(n, 0, 32) == flat.p2p_time(n, 0, 32)  # uplinks of 4 / 4: room for one
    assert thin.p2p_time(n, 0, 8) == flat.p2p_time(n, 0, 8)           # same leaf
    # a ring leaves each leaf once per rail: one NIC's stream, which uplinks of 4 NICs / 4 carry
    assert model(4.0).collective_time("all_gather", n, across) == flat.collective_time("all_gather", n, across)
    assert model(4.0).collective_time("all_to_all", n, across) > flat.collective_time("all_to_all", n, across)


def test_fabric_fields_are_validated():
    with pytest.raises(ValueError, match="oversubscription"):
        spec(fabric=FabricSpec(oversubscription=0.5))
    with pytest.raises(ValueError, match="nvls_bandwidth_gbps"):
        spec(nvls=True)
    with pytest.raises(ValueError, match="curve_exponent"):
        LinkSpec(bandwidth_gbps=1.0, latency_us=1.0, curve_exponent=0.0)


# --------------------------------------------------------------------------- nccl fit bench


def _bench():
    path = Path(__file__).resolve().parents[3] / "bench" / "nccl_fit.py"
    spec_ = importlib.util.spec_from_file_location("nccl_fit", path)
    mod = importlib.util.module_from_spec(spec_)
    sys.modules["nccl_fit"] = mod          # its dataclasses look their module up
    spec_.loader.exec_module(mod)
    return mod


def test_nccl_fit_held_out_error_check_fails_on_a_planted_bad_point(capsys):
    fit = _bench()
    systems, required, rows = fit.load()
    good = fit.evaluate(systems, required, rows)
    assert good.held_out_error <= 0.10
    assert good.sources >= 3
    checks = [i for i, r in enumerate(rows) if r.role == "check" and r.system == "azure_nd_h100_v5"]
    bad = list(rows)
    # one point off by 10x (a +900% error) outweighs the ~90 good held-out rows' average
    bad[checks[2]] = dataclasses.replace(rows[checks[2]], busbw_gbps=rows[checks[2]].busbw_gbps / 10)
    res = fit.evaluate(systems, required, bad)
    assert res.held_out_error > 0.10
    all_covered = dict(required, ops=["all_reduce"], nodes=["1", "2"])
    assert fit.report(systems, fit.evaluate(systems, all_covered, rows), 0.10) == 0
    assert fit.report(systems, fit.evaluate(systems, all_covered, bad), 0.10) == 1
    assert "MISSED" in capsys.readouterr().out


def test_replay_data_parallel_reduce_scatter_and_pipeline_send_share_the_nic():
    from prism_launch.predict.simulate import COLL

    model = NcclCostModel(spec())
    n = 256 * MIB
    rs = ("reduce_scatter", n, (0, 8))                 # DP pair on two nodes: rail-0 NICs
    send = (0, 0, 16, 0, 0)                            # PP send from GPU 0 to node 2: rail-0 NIC too

    def graph(with_send):
        g = {0: [(COLL, 0.0, ("c", 1, 0), rs)], 8: [(COLL, 0.0, ("c", 1, 0), rs), (WAIT, 0.0, ("c", 1, 0), None)]}
        if with_send:
            g[0].append((SEND, 0.0, send, n))
            g[16] = [(RECV, 0.0, send, None), (WAIT, 0.0, ("r", send), None)]
            g[0].append((WAIT, 0.0, ("s", send), None))
        g[0].append((WAIT, 0.0, ("c", 1, 0), None))
        for evs in g.values():
            evs.append((MARK, 0.0, 0, None))
        return Graph(g, 24)

    alone = replay(graph(False), model).iteration_time_s
    assert alone == pytest.approx(model.collective_time(*rs))
    both = replay(graph(True), model)
    assert both.slowed_flows == 2
    assert both.iteration_time_s > 1.5 * alone


def test_whole_node_collective_is_claimed_alone_unless_its_ports_are_busy():
    from prism_launch.predict.simulate import COLL

    model = NcclCostModel(spec())
    n = 64 * MIB
    ar = ("all_reduce", n, tuple(range(8)))
    key = ("c", 1, 0)

    def graph(with_p2p):
        g = {r: [(COLL, 0.0, key, ar), (WAIT, 0.0, key, None)] for r in range(8)}
        if with_p2p:   # GPU 0 sends to GPU 1 over NVLink while the all_reduce runs
            send = (0, 0, 1, 0, 0)
            g[0] = [(SEND, 0.0, send, n), *g[0], (WAIT, 0.0, ("s", send), None)]
            g[1] = [*g[1], (RECV, 0.0, send, None), (WAIT, 0.0, ("r", send), None)]
        for evs in g.values():
            evs.append((MARK, 0.0, 0, None))
        return Graph(g, 8)

    alone = replay(graph(False), model)
    assert alone.iteration_time_s == pytest.approx(model.collective_time(*ar))
    assert (alone.flows, alone.slowed_flows) == (1, 0)
    busy = replay(graph(True), model)
    assert busy.slowed_flows == 2          # the send holds ports 0 and 1: no claim, both share
    assert busy.iteration_time_s > alone.iteration_time_s + 0.5 * model.p2p_time(n, 0, 1)
