"""The pipeline picture's data: one steady-state iteration per stage (start-up excluded), its
micro-batches labelled from the stage's point-to-point traffic, bubble and exposed waits."""

from prism_launch.report.pipeline_view import pipeline_view


def _ev(kind, op=None, peer=-1):
    return {"kind": kind, "op": op, "peer": peer}


# one 1F1B step of two stages and two micro-batches: (event, compute span before it)
STAGE0 = [(_ev("p2p", "send", 1), 1.0),             # F1 -> stage 1
          (_ev("p2p", "send", 1), 1.0),             # F2 -> stage 1
          (_ev("p2p", "recv", 1), 0.0), (_ev("wait"), 0.0),  # gradient of 1 (bubble)
          (_ev("p2p", "recv", 1), 1.0), (_ev("wait"), 0.0),  # B1, then gradient of 2
          (_ev("collective", "all_reduce"), 1.0), (_ev("wait"), 0.0),  # B2, then DP gradients (exposed)
          (_ev("marker"), 0.2)]                     # optimizer
STAGE1 = [(_ev("p2p", "recv", 0), 0.0), (_ev("wait"), 0.0),
          (_ev("p2p", "send", 0), 2.0),             # F1 and B1 in one block
          (_ev("p2p", "recv", 0), 0.0), (_ev("wait"), 0.0),
          (_ev("p2p", "send", 0), 2.0),
          (_ev("collective", "all_reduce"), 0.0), (_ev("wait"), 0.0), (_ev("marker"), 0.2)]


def _times(events, waits_until):
    """Issue times of a stage's events over two steps (each wait that blocks: until the given time)."""
    t, out = 0.0, []
    for i, (_e, span) in enumerate(events):
        t += span
        t = max(t, waits_until.get(i, t))
        out.append(t)
    return out


def _two_steps():
    rows, spans, issue, ends = {}, {}, {}, {}
    for rank, events, waits in ((0, STAGE0, {3: 4.0, 5: 5.5, 7: 7.0}), (1, STAGE1, {1: 1.0, 4: 3.0, 7: 5.5})):
        one = _times(events, waits)
        step = one[-1] + 0.5  # the first step ends later: start-up
        rows[rank] = [e for e, _ in events] * 2
        spans[rank] = [s for _, s in events] * 2
        issue[rank] = one + [t + step for t in one]
        ends[rank] = [step, step + one[-1]]
    timelines = {0: [("compute", 0, 1), ("p2p-wait", 9.7, 11.7), ("wait", 14.2, 14.7)],
                 1: [("p2p-wait", 0.0, 1.0), ("wait", 4.0, 4.5)]}
    return rows, spans, issue, ends, timelines


def test_one_steady_iteration_with_labelled_micro_batches():
    rows, spans, issue, ends, timelines = _two_steps()
    views, (lo, hi) = pipeline_view([0, 1], rows, spans, issue, ends, timelines)
    assert (lo, hi) == (min(ends[0][0], ends[1][0]), max(ends[0][1], ends[1][1]))  # the second step only
    s0, s1 = views
    assert (s0.stage, s1.stage) == (0, 1)
    assert [b.label for b in s0.blocks] == ["F1", "F2", "B1", "B2"]
    assert [b.label for b in s1.blocks] == ["F1+B1", "F2+B2", ""]  # the optimizer: no micro-batch
    assert abs((s1.blocks[-1].t1 - s1.blocks[-1].t0) - 0.2) < 1e-9
    assert all(lo <= b.t0 < b.t1 <= hi for v in views for b in v.blocks)
    assert s0.waits == [("bubble", 9.7, 11.7), ("comm", 14.2, 14.7)]  # inside the window, by kind
    assert s1.waits == []  # its waits were in the start-up step


def test_a_single_step_is_drawn_from_its_start():
    rows, spans, issue, ends, timelines = _two_steps()
    one = {r: v[:1] for r, v in ends.items()}
    views, (lo, _hi) = pipeline_view([0, 1], rows, spans, issue, one, timelines)
    assert lo == 0.0 and [b.label for b in views[0].blocks] == ["F1", "F2", "B1", "B2"]


def test_blocks_draw_compute_only_not_the_waits_inside_them():
    rows, spans, issue, ends, timelines = _two_steps()
    views, _ = pipeline_view([0, 1], rows, spans, issue, ends, timelines)
    for v in views:
        for b in v.blocks:
            assert b.segments and b.segments[0][0] == b.t0 and b.segments[-1][1] == b.t1
            for kind, t0, t1 in v.waits:  # no compute drawn under a wait
                assert all(z <= t0 or a >= t1 for a, z in b.segments)
