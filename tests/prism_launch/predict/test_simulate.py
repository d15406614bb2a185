"""Global replay on synthetic graphs with hand-computed timelines."""

import pytest

from prism_launch.predict.simulate import COLL, MARK, RECV, SEND, WAIT, Graph, replay


class Flat:
    """Every collective costs ``coll`` seconds, every message ``p2p``."""

    def __init__(self, coll=0.0, p2p=0.0):
        self.coll, self.p2p = coll, p2p

    def collective_time(self, kind, nbytes, ranks):
        return self.coll

    def p2p_time(self, nbytes, src, dst):
        return self.p2p


def _send(span, src, dst, n):
    key = (0, src, dst, 0, n)
    return [(SEND, span, key, 4), (WAIT, 0.0, ("s", key), None)]


def _recv(span, src, dst, n):
    key = (0, src, dst, 0, n)
    return [(RECV, span, key, None), (WAIT, 0.0, ("r", key), None)]


def test_pipeline_1f1b_bubbles_and_iteration_time():
    # stage 0: F0 F1 | B0 B1 ; stage 1: F0 B0 F1 B1 (forward 1 s, backward 2 s), free network
    s0 = [*_send(1.0, 0, 1, 0), *_send(1.0, 0, 1, 1), *_recv(0.0, 1, 0, 0), *_recv(2.0, 1, 0, 1),
          (MARK, 2.0, 0, None)]
    s1 = [*_recv(0.0, 0, 1, 0), *_send(3.0, 1, 0, 0), *_recv(0.0, 0, 1, 1), *_send(3.0, 1, 0, 1),
          (MARK, 0.0, 0, None)]
    rep = replay(Graph({0: s0, 1: s1}, 2), Flat(), timeline_ranks=[0, 1])
    # stage1: waits until 1, F0+B0 1..4 sends g0@4; a1 arrived at 2: F1+B1 4..7 sends g1@7
    # stage0: F0 0..1, F1 1..2, waits g0 until 4, B0 4..6, waits g1 until 7, B1 7..9
    assert rep.ranks[0].step_ends == [9.0]
    assert rep.ranks[1].step_ends == [7.0]
    assert rep.iteration_times == [9.0]
    assert rep.ranks[0].bubble_s == pytest.approx(3.0)   # 2..4 and 6..7
    assert rep.ranks[1].bubble_s == pytest.approx(1.0)   # 0..1
    kinds = [k for k, *_ in rep.timelines[0]]
    assert kinds.count("p2p-wait") == 2
    # the critical path ends on stage 0 and passes through stage 1's backward
    assert rep.critical_path[-1]["rank"] == 0
    assert any(seg["rank"] == 1 for seg in rep.critical_path)
    assert sum(seg["s"] for seg in rep.critical_path) == pytest.approx(9.0)


@pytest.mark.parametrize(("cost", "iteration", "exposed"), [(1.5, 3.0, 0.0), (3.0, 4.0, 1.0)])
def test_overlapped_data_parallel_all_reduce(cost, iteration, exposed):
    # backward: 1 s, then the gradient all-reduce is issued async, 2 more s of compute, then wait
    def rank():
        return [(COLL, 1.0, ("c", 0, 0), ("all_reduce", 1 << 20, (0, 1))), (WAIT, 2.0, ("c", 0, 0), None),
                (MARK, 0.0, 0, None)]

    rep = replay(Graph({0: rank(), 1: rank()}, 2), Flat(coll=cost))
    assert rep.iteration_times == [pytest.approx(iteration)]
    assert rep.ranks[0].blocked_s == pytest.approx(exposed)
    assert rep.ranks[0].compute_s == pytest.approx(3.0)


def test_moe_all_to_all_straggler():
    spans = {0: 1.0, 1: 1.0, 2: 5.0, 3: 1.5}
    g = {r: [(COLL, s, ("c", 1, 0), ("all_to_all", 4096, (0, 1, 2, 3))), (WAIT, 0.0, ("c", 1, 0), None),
             (MARK, 1.0, 0, None)] for r, s in spans.items()}
    rep = replay(Graph(g, 4), Flat(coll=0.5))
    assert rep.iteration_times == [pytest.approx(6.5)]        # 5 + 0.5 + 1
    assert rep.stragglers[0] == {"rank": 2, "delay_caused_s": pytest.approx(3.5)}  # 5 vs next-latest 1.5
    assert rep.ranks[0].blocked_s == pytest.approx(4.5)
    assert rep.ranks[2].blocked_s == pytest.approx(0.5)


def test_multi_step_iteration_time_skips_warmup():
    g = {0: [(MARK, 3.0, 0, None), (MARK, 1.0, 1, None), (MARK, 1.0, 2, None)]}
    rep = replay(Graph(g, 1), Flat())
    assert rep.iteration_times == [3.0, 1.0, 1.0]
    assert rep.iteration_time_s == 1.0


def test_incomplete_trace_is_reported_not_hung():
    g = {0: [(COLL, 0.0, ("c", 0, 0), ("all_reduce", 4, (0, 1))), (WAIT, 0.0, ("c", 0, 0), None)], 1: []}
    with pytest.raises(RuntimeError, match="deadlocked: 1 rank"):
        replay(Graph(g, 2), Flat())


def test_steady_step_splits_waits_by_group_and_skips_the_first_step():
    # three steps on two ranks: a TP all-reduce (group 3) that rank 1 reaches late, then a
    # pipeline receive from rank 1; the first step's compute is longer (warm-up)
    def step(n, first, late):
        tp = ("c", 3, n)
        key = (0, 1, 0, 0, n)
        r0 = [(COLL, first, tp, ("all_reduce", 64, (0, 1))), (WAIT, 0.0, tp, None),
              (RECV, 0.0, key, None), (WAIT, 0.0, ("r", key), None), (MARK, 0.5, n, None)]
        r1 = [(COLL, first + late, tp, ("all_reduce", 64, (0, 1))), (WAIT, 0.0, tp, None),
              (SEND, 0.25, key, 4), (WAIT, 0.0, ("s", key), None), (MARK, 0.25, n, None)]
        return r0, r1

    steps = [step(0, 3.0, 1.0), step(1, 1.0, 1.0), step(2, 1.0, 1.0)]
    g = {0: [e for s in steps for e in s[0]], 1: [e for s in steps for e in s[1]]}
    rep = replay(Graph(g, 2), Flat(coll=0.5))
    first = rep.ranks[0].marks[0]
    assert first[3] == {3: pytest.approx(1.5)}           # 1 s late peer + 0.5 s all-reduce
    steady = rep.ranks[0].steady_step()
    # after the first step: compute 1 + 0.5; rank 0 ends each step 0.25 s after rank 1 (it waits
    # for rank 1's send), so rank 1's 1 s lateness costs it 0.75 s, plus the 0.5 s all-reduce
    assert steady["compute_s"] == pytest.approx(1.5)
    assert steady["blocked_by_group"] == {3: pytest.approx(1.25)}
    assert steady["bubble_s"] == pytest.approx(0.25)
    assert steady["blocked_s"] == pytest.approx(1.5)
    assert rep.ranks[1].steady_step()["blocked_by_group"] == {3: pytest.approx(0.5)}


def _two_in_flight():
    info = ("all_reduce", 1 << 20, (0, 1))
    return [(COLL, 1.0, ("c", 0, 0), info), (COLL, 0.0, ("c", 0, 1), info), (WAIT, 2.0, ("c", 0, 0), None),
            (WAIT, 0.0, ("c", 0, 1), None), (MARK, 0.0, 0, None)]


def test_collectives_on_the_cores_overlap_no_work_before_their_wait():
    # two all-reduces in flight, 2 s of work before the waits, each 1.5 s: overlapped they finish at
    # 2.5 under the work (step 3 s); on a CPU cluster each takes the rank's cores after its issue
    # (1..2.5, 2.5..4), then the 2 s of work: step 6 s, 3 s of it communication
    graph = Graph({0: _two_in_flight(), 1: _two_in_flight()}, 2)
    assert replay(graph, Flat(coll=1.5)).iteration_times == [pytest.approx(3.0)]
    rep = replay(graph, Flat(coll=1.5), comm_on_cores=True, timeline_ranks=[0])
    assert rep.iteration_times == [pytest.approx(6.0)]
    assert rep.ranks[0].blocked_s == pytest.approx(3.0) and rep.ranks[0].blocked_by_group == {0: pytest.approx(3.0)}
    assert [k for k, *_ in rep.timelines[0]].count("wait") == 2


@pytest.mark.parametrize(("cost", "iteration"), [(1.5, 3.0), (3.0, 4.0)])
def test_a_collective_waited_at_once_is_priced_alike_on_the_cores(cost, iteration):
    def rank():  # the span before its wait is the op's own handling: the transfer overlaps it
        return [(COLL, 1.0, ("c", 0, 0), ("all_reduce", 1 << 20, (0, 1))), (WAIT, 2.0, ("c", 0, 0), None),
                (MARK, 0.0, 0, None)]

    rep = replay(Graph({0: rank(), 1: rank()}, 2), Flat(coll=cost), comm_on_cores=True)
    assert rep.iteration_times == [pytest.approx(iteration)]
