"""Shard classes from a trace's group structure and event sequences, the slices that measure
them, and calibration giving every member of a class its measurements' median."""

from types import SimpleNamespace

import pytest

from prism_launch.config import Measure
from prism_launch.predict.calibrate import apply_spans
from prism_launch.predict.shard_classes import (ShardClass, event_signatures, measurement_slices, pipeline_stages,
                                                shard_classes)


def megatron_groups(tp: int, pp: int, dp: int) -> list[tuple[tuple[int, ...], str]]:
    """Megatron's rank order (tp fastest, then dp, then pp) and group names."""
    world = tp * pp * dp
    groups = [(tuple(range(world)), "default_pg")]
    for s in range(pp):
        for d in range(dp):
            base = s * tp * dp + d * tp
            groups.append((tuple(range(base, base + tp)), "TENSOR_MODEL_PARALLEL_GROUP"))
        for t in range(tp):
            groups.append((tuple(s * tp * dp + d * tp + t for d in range(dp)), "DATA_PARALLEL_GROUP"))
    for i in range(tp * dp):
        groups.append((tuple(i + s * tp * dp for s in range(pp)), "PIPELINE_MODEL_PARALLEL_GROUP"))
        groups.append(((i, i + (pp - 1) * tp * dp), "EMBEDDING_GROUP"))
    return groups


def test_tp8_pp4_at_8192_ranks_is_four_classes_one_per_stage():
    groups = megatron_groups(8, 4, 256)
    classes = shard_classes(groups, range(8192))
    assert len(classes) == 4
    assert [c.stage for c in classes] == [0, 1, 2, 3]
    assert all(len(c.members) == 2048 for c in classes)
    # the TP peers of a stage and their data-parallel replicas share the class; stages do not
    assert set(range(8)) <= set(classes[0].members) and 2048 not in classes[0].members
    assert classes[3].representative == 3 * 2048


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (2, 2, 1), (2, 2, 2), (1, 1, 4), (4, 2, 1)])
def test_classes_are_the_pipeline_stages_of_any_tp_pp_dp_world(tp, pp, dp):
    classes = shard_classes(megatron_groups(tp, pp, dp), range(tp * pp * dp))
    assert len(classes) == pp
    assert sorted(r for c in classes for r in c.members) == list(range(tp * pp * dp))


def _rows(rank: int, ops: list[tuple[str, str, int, int]]) -> list[dict]:
    return [{"rank": rank, "idx": i, "kind": k, "op": op, "nbytes": n, "group": g} for i, (k, op, n, g) in enumerate(ops)]


def test_different_event_sequences_split_a_class_whatever_the_groups_say():
    """No pipeline group named (DeepSpeed's pipe, say): the first and last stage still differ by
    their sends and receives; two TP peers with the same sequence over different groups of the
    same size stay together."""
    sizes = {1: 2, 2: 2, 3: 2}
    rows = (_rows(0, [("collective", "allreduce", 64, 1), ("p2p", "send", 32, 3)])
            + _rows(1, [("collective", "allreduce", 64, 2), ("p2p", "send", 32, 3)])
            + _rows(2, [("p2p", "recv", 32, 3), ("collective", "allreduce", 64, 1)]))
    sigs = event_signatures(rows, sizes)
    classes = shard_classes([((0, 1, 2), "default_pg")], [0, 1, 2], sigs)
    assert [c.members for c in classes] == [(0, 1), (2,)]


def test_measurement_slices_use_distinct_members_and_fill_every_device():
    classes = [ShardClass((0, 1), 0), ShardClass((2, 3), 1), ShardClass((4,), 2)]
    slices = measurement_slices(classes, repeats=3, per_slice=2)
    assert all(len(s) == len(set(s)) <= 2 for s in slices)
    flat = [r for s in slices for r in s]
    for c in classes:  # every class measured three times, spread over its members
        assert sum(flat.count(r) for r in c.members) == 3
    assert flat.count(0) == 2 and flat.count(1) == 1 and flat.count(4) == 3
    assert len(slices) == 5  # 9 measurements, 2 per slice, one class of one member repeated alone
    assert measurement_slices([ShardClass((0, 1), None)], repeats=2, per_slice=2) == [[0, 1]]


class _Reader:
    def __init__(self, rows):
        self._rows = rows

    def events(self):
        return SimpleNamespace(to_pylist=lambda: [dict(r) for r in self._rows])


def _events(ranks, codes=("collective", "wait")):
    return [{"rank": r, "idx": i, "kind": k, "op": "allreduce" if k == "collective" else "wait", "extra": None,
             "compute_cpu_s": 1.0, "compute_wall_s": 1.0} for r in ranks for i, k in enumerate(codes)]


def test_a_class_gets_the_per_event_median_of_its_measurements_on_every_member():
    classes = [ShardClass((0, 1, 2, 3), 0), ShardClass((4, 5), 1)]
    runs = {0: [[["c", 0, 0.010, None], ["w", 0, 0.001, None]],
                [["c", 0, 0.030, None], ["w", 0, 0.003, None]]],
            1: [[["c", 0, 0.020, None], ["w", 0, 0.009, None]]],
            4: [[["c", 0, 0.500, None], ["w", 0, 0.100, None]]]}
    out = apply_spans(_Reader(_events(range(6))), runs, Measure.wall, classes)
    by = {(r["rank"], r["idx"]): r["compute_wall_s"] for r in out.rows}
    # measured or not, every member of class 0: the median per event (0.02, 0.003), scaled to the
    # median run's total (runs 0.011, 0.033, 0.029: 0.029)
    for r in range(4):
        assert (by[(r, 0)], by[(r, 1)]) == pytest.approx((0.020 * 0.029 / 0.023, 0.003 * 0.029 / 0.023))
    assert (by[(5, 0)], by[(5, 1)]) == (0.5, 0.1)
    assert out.replaced == 12 and out.mismatched == []
    assert [c["measurements"] for c in out.classes] == [3, 1]
    assert all(r["extra"] and "bare_wall_s" in r["extra"] for r in out.rows)


def test_skewed_noise_keeps_the_median_runs_steady_total_and_leaves_warm_up_alone():
    """Each run is late at a different event: per-event medians alone would sum to 3 ms a step where
    every run took 4. The warm-up step (before the first step marker) keeps its medians."""
    codes = ("collective", "marker", "collective", "wait", "collective")
    rows = _events([0], codes)
    rows[1]["op"] = "step"
    runs = {0: [[[k, 0, v, None] for k, v in zip("cmcwc", vals)]
                for vals in ([5.0, 0, 1.0, 1.0, 2.0], [9.0, 0, 1.0, 2.0, 1.0], [7.0, 0, 2.0, 1.0, 1.0])]}
    out = apply_spans(_Reader(rows), runs, Measure.wall, [ShardClass((0,), 0)])
    spans = [r["compute_wall_s"] for r in sorted(out.rows, key=lambda r: r["idx"])]
    assert spans[:2] == [7.0, 0.0]
    assert spans[2:] == pytest.approx([4 / 3] * 3) and sum(spans[2:]) == pytest.approx(4.0)
    assert out.classes[0]["steady_scale"] == pytest.approx(4 / 3)
    one = apply_spans(_Reader(rows), {0: runs[0][:1]}, Measure.wall, [ShardClass((0,), 0)])
    assert [r["compute_wall_s"] for r in sorted(one.rows, key=lambda r: r["idx"])] == [5.0, 0, 1.0, 1.0, 2.0]


def test_a_member_whose_run_issued_other_events_is_left_out_and_named():
    classes = [ShardClass((0, 1), 0)]
    runs = {0: [[["c", 0, 0.01, None], ["w", 0, 0.002, None]]], 1: [[["w", 0, 0.5, None]]]}
    out = apply_spans(_Reader(_events([0, 1])), runs, Measure.wall, classes)
    assert out.mismatched == [1]
    by = {(r["rank"], r["idx"]): r["compute_wall_s"] for r in out.rows}
    assert by[(0, 0)] == 0.01 and by[(1, 0)] == 1.0  # rank 1 keeps its bare spans


def test_pipeline_stages_ignore_groups_that_only_mention_pipelines():
    groups = [((0, 1), "PIPELINE_MODEL_PARALLEL_GROUP"), ((0, 2), "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP")]
    assert pipeline_stages(groups) == {0: 0, 1: 1}


def test_a_broadcasts_receivers_are_the_same_shard_as_its_root():
    """Megatron's TP rank 0 loads the batch and broadcasts it; its peers record no bytes of their
    own for the broadcast. They are one class all the same (the op's bytes are the root's), and a
    different sequence elsewhere still splits them."""
    sizes = {1: 2}
    rows = [{"rank": 0, "idx": 0, "kind": "collective", "op": "broadcast", "nbytes": 4096, "group": 1, "seq": 0},
            {"rank": 1, "idx": 0, "kind": "collective", "op": "broadcast", "nbytes": 0, "group": 1, "seq": 0},
            {"rank": 0, "idx": 1, "kind": "collective", "op": "allreduce", "nbytes": 64, "group": 1, "seq": 1},
            {"rank": 1, "idx": 1, "kind": "collective", "op": "allreduce", "nbytes": 64, "group": 1, "seq": 1}]
    classes = shard_classes([((0, 1), "TENSOR_MODEL_PARALLEL_GROUP")], [0, 1], event_signatures(rows, sizes))
    assert [c.members for c in classes] == [(0, 1)]
    rows[3]["nbytes"] = rows[2]["nbytes"] = 128  # the op's bytes are still one figure for both
    rows.append({"rank": 1, "idx": 2, "kind": "p2p", "op": "send", "nbytes": 8, "group": 1, "seq": 0})
    classes = shard_classes([((0, 1), "TENSOR_MODEL_PARALLEL_GROUP")], [0, 1], event_signatures(rows, sizes))
    assert [c.members for c in classes] == [(0,), (1,)]


def _stepped(n_steps: int) -> list[dict]:
    """One rank: a warm-up step, then ``n_steps - 1`` steady steps of (collective, wait, marker)."""
    codes = ["collective", "wait", "marker"] * n_steps
    rows = _events([0], codes)
    for r in rows:
        if r["kind"] == "marker":
            r["op"] = "step"
    return rows


def test_steady_steps_are_pooled_so_one_slow_step_of_one_run_is_outvoted():
    """One run, four steps: the warm-up keeps its own spans; the three steady steps are the same
    work, so each event takes the median over them and a step sums to the median step total: the
    step that took 9 ms (a host hiccup) does not move the prediction, as it would through a
    per-event median of one run."""
    rows = _stepped(4)
    step = lambda c, w, m: [["c", 0, c, None], ["w", 0, w, None], ["m", 0, m, None]]  # noqa: E731
    run = step(50.0, 5.0, 5.0) + step(1.0, 0.5, 0.5) + step(1.2, 0.4, 0.4) + step(8.0, 0.5, 0.5)
    out = apply_spans(_Reader(rows), {0: [run]}, Measure.wall, [ShardClass((0,), 0)])
    spans = [r["compute_wall_s"] for r in sorted(out.rows, key=lambda r: r["idx"])]
    assert spans[:3] == [50.0, 5.0, 5.0]
    pooled = [1.2, 0.5, 0.5]  # per-event medians over the steady steps; step totals 2.0, 2.0, 9.0
    for k in (3, 6, 9):
        assert spans[k:k + 3] == pytest.approx([v * 2.0 / 2.2 for v in pooled])
    assert sum(spans[9:12]) == pytest.approx(2.0)
    assert out.classes[0]["steady_steps_pooled"] == 3
    assert out.classes[0]["steady_scale"] == pytest.approx(2.0 / 2.2)


def test_a_profiled_steady_step_gives_the_pool_no_sample_where_two_others_remain():
    """``calibrate.kernel_mix`` traces every run's first steady step (kernel tracing slows the
    host): that step's 9 ms is left out of the pool, yet it gets the pooled spans like the others;
    with only two steady steps, both are kept (one sample would be no median)."""
    rows = _stepped(4)
    step = lambda c, w, m: [["c", 0, c, None], ["w", 0, w, None], ["m", 0, m, None]]  # noqa: E731
    run = step(50.0, 5.0, 5.0) + step(8.0, 0.5, 0.5) + step(1.0, 0.5, 0.5) + step(1.2, 0.4, 0.4)
    out = apply_spans(_Reader(rows), {0: [run]}, Measure.wall, [ShardClass((0,), 0)], profiled_steps=1)
    spans = [r["compute_wall_s"] for r in sorted(out.rows, key=lambda r: r["idx"])]
    pooled = [1.1, 0.45, 0.45]  # medians of the last two steps; their totals 2.0 and 2.0
    for k in (3, 6, 9):
        assert spans[k:k + 3] == pytest.approx(pooled)
    assert out.classes[0]["steady_steps_pooled"] == 2 and out.classes[0]["profiled_steps_left_out"] == 1
    short = _stepped(3)
    out = apply_spans(_Reader(short), {0: [run[:9]]}, Measure.wall, [ShardClass((0,), 0)], profiled_steps=1)
    assert out.classes[0]["steady_steps_pooled"] == 2 and "profiled_steps_left_out" not in out.classes[0]


def test_steady_steps_of_the_common_sequence_are_pooled_and_a_different_first_one_keeps_its_spans():
    """torchtitan's first steady step adds a barrier: the three later steps, the same work, are
    pooled; the first (profiled, and different) keeps its own spans, and gives the pool nothing."""
    rows = _stepped(5)
    rows[4]["nbytes"] = 1  # the first full steady step's wait differs from the later ones'
    step = lambda c, w, m: [["c", 0, c, None], ["w", 0, w, None], ["m", 0, m, None]]  # noqa: E731
    run = step(50.0, 5.0, 5.0) + step(9.0, 9.0, 9.0) + step(1.0, 0.5, 0.5) + step(1.2, 0.4, 0.4) + step(1.1, 0.6, 0.5)
    out = apply_spans(_Reader(rows), {0: [run]}, Measure.wall, [ShardClass((0,), 0)], profiled_steps=1)
    spans = [r["compute_wall_s"] for r in sorted(out.rows, key=lambda r: r["idx"])]
    assert spans[3:6] == [9.0, 9.0, 9.0]
    for k in (6, 9, 12):
        assert sum(spans[k:k + 3]) == pytest.approx(2.0)  # the median step total of the three
    assert out.classes[0]["steady_steps_pooled"] == 3 and "profiled_steps_left_out" not in out.classes[0]


def test_the_steady_step_span_is_the_median_step_total_of_a_rank():
    from prism_launch.predict.calibrate import steady_step_span

    rows = _stepped(4)
    for r, v in zip(sorted(rows, key=lambda r: r["idx"]), [50, 5, 5, 1, 1, 1, 2, 1, 1, 9, 1, 1]):
        r["compute_wall_s"] = float(v)
    assert steady_step_span(rows, 0) == 4.0  # steps of 3, 4 and 11
    assert steady_step_span(rows, 1) is None


def test_steady_steps_that_issue_different_events_are_not_pooled():
    rows = _stepped(3)
    rows[4]["nbytes"] = 1  # the second step's wait differs from the third's
    rows[7]["nbytes"] = 2
    run = [["c", 0, v, None] if i % 3 == 0 else ["w" if i % 3 == 1 else "m", 0, v, None]
           for i, v in enumerate([5.0, 1.0, 1.0, 1.0, 0.5, 0.5, 3.0, 0.5, 0.5])]
    out = apply_spans(_Reader(rows), {0: [run]}, Measure.wall, [ShardClass((0,), 0)])
    spans = [r["compute_wall_s"] for r in sorted(out.rows, key=lambda r: r["idx"])]
    assert spans == [5.0, 1.0, 1.0, 1.0, 0.5, 0.5, 3.0, 0.5, 0.5]
    assert "steady_steps_pooled" not in out.classes[0]
