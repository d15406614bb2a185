"""Global replay throughput at scale: a synthetic TP·PP·DP Megatron-like graph (1F1B
pipeline — warm-up forwards, one-forward-one-backward, cool-down backwards, as Megatron's
``forward_backward_pipelining_without_interleaving`` orders them — with tensor-parallel
all-reduces and a data-parallel gradient all-reduce per step) of WORLD ranks, replayed with
the NCCL-like cost model of ``--cluster``.

    python bench/replay_scale.py [--world 8192] [--tp 8] [--pp 4] [--microbatches 8] [--steps 4]

Prints events, wall time and events/s (the goal: an 8,192-rank graph with thousands of events
per rank in under 60 s on a 2-core machine), and the predicted iteration time beside 1F1B's
closed form, (microbatches + pp - 1) x (forward + backward of one micro-batch) plus the
pipeline's transfers and the step's tail; exits 1 when they differ by more than 10% (the
replay of the pipeline's dependencies is off) or when the cluster preset cannot be loaded.
(All-forward-all-backward has the same closed form; 1F1B differs in keeping at most
``pp - stage`` micro-batches in flight, which :func:`one_f_one_b`'s order does.)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import Figure, Goal, report  # noqa: E402
from prism_launch.predict.simulate import COLL, MARK, RECV, SEND, WAIT, Graph, replay  # noqa: E402


FWD_S, BWD_S, DP_SPAN_S, MARK_S = 2e-4, 4e-4, 1e-4, 1e-3
"""Compute before each forward / backward layer's all-reduce, before the gradient all-reduce,
before the step's end."""
P2P_BYTES, TP_BYTES, DP_BYTES = 1 << 20, 1 << 21, 1 << 26


def one_f_one_b(pp: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order for ``stage``: ("F" | "B", micro-batch)."""
    warm = min(pp - stage - 1, microbatches)
    order = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < microbatches:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    order += [("B", i) for i in range(b, microbatches)]
    return order


def build(world: int, tp: int, pp: int, microbatches: int, steps: int, layers: int) -> Graph:
    dp = world // (tp * pp)
    ranks = {}
    for r in range(world):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        tp_group = tuple(range(r - t, r - t + tp))
        dp_group = tuple(p * tp * dp + dd * tp + t for dd in range(dp))
        prev, nxt = (r - tp * dp if p > 0 else None), (r + tp * dp if p < pp - 1 else None)
        evs: list[tuple] = []
        seq_tp, seq_dp, n_p2p = 0, 0, {}

        def p2p(kind, src, dst):
            k = (src, dst)
            n = n_p2p.get(k, 0)
            n_p2p[k] = n + 1
            key = (1, src, dst, 0, n)
            if kind == "send":
                evs.append((SEND, 0.0, key, P2P_BYTES))
                evs.append((WAIT, 0.0, ("s", key), None))
            else:
                evs.append((RECV, 0.0, key, None))
                evs.append((WAIT, 0.0, ("r", key), None))

        def tp_layer(span):
            nonlocal seq_tp
            for _ in range(layers):
                key = ("c", 10_000 + r // tp, seq_tp)
                evs.append((COLL, span, key, ("all_reduce", TP_BYTES, tp_group)))
                evs.append((WAIT, 0.0, key, None))
                seq_tp += 1

        for step in range(steps):
            for phase, _mb in one_f_one_b(pp, p, microbatches):
                if phase == "F":
                    if prev is not None:
                        p2p("recv", prev, r)
                    tp_layer(FWD_S)
                    if nxt is not None:
                        p2p("send", r, nxt)
                else:
                    if nxt is not None:
                        p2p("recv", nxt, r)
                    tp_layer(BWD_S)
                    if prev is not None:
                        p2p("send", r, prev)
            key = ("c", 20_000 + p * tp + t, seq_dp)
            evs.append((COLL, DP_SPAN_S, key, ("all_reduce", DP_BYTES, dp_group)))
            evs.append((WAIT, 0.0, key, None))
            seq_dp += 1
            evs.append((MARK, MARK_S, step, None))
        ranks[r] = evs
    return Graph(ranks=ranks, world_size=world)


def expected_iteration_s(model, world: int, tp: int, pp: int, microbatches: int, layers: int) -> float:
    """1F1B's closed form on this graph: (m + pp - 1) slots of one forward plus one backward
    (each layer's span and its TP all-reduce), a forward and a backward transfer per stage
    boundary, then the gradient all-reduce and the step's tail."""
    dp = world // (tp * pp)
    tp_ar = model.collective_time("all_reduce", TP_BYTES, tuple(range(tp)))
    fwd, bwd = layers * (FWD_S + tp_ar), layers * (BWD_S + tp_ar)
    hop = model.p2p_time(P2P_BYTES, 0, tp * dp) if pp > 1 else 0.0
    dp_ar = model.collective_time("all_reduce", DP_BYTES, tuple(range(0, tp * dp, tp)))
    return (microbatches + pp - 1) * (fwd + bwd) + 2 * (pp - 1) * hop + DP_SPAN_S + dp_ar + MARK_S


def figures(predicted_s: float | None, closed_form_s: float, events_per_s: float | None = None) -> list[Figure]:
    """The replay's iteration time and its relative difference from 1F1B's closed form, which
    must be within 10%."""
    diff = None if predicted_s is None or not math.isfinite(predicted_s) else (predicted_s - closed_form_s) / closed_form_s
    return [Figure("replay events/s", events_per_s, fmt=",.0f"),
            Figure("predicted iteration ms", None if diff is None else predicted_s * 1e3, fmt=".2f"),
            Figure("1F1B closed form ms", closed_form_s * 1e3, fmt=".2f"),
            Figure("replayed vs closed form", diff, Goal("within ±10%", lambda d: abs(d) <= 0.10), "+.2%")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8192)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cluster", default="h100_ib")
    a = ap.parse_args()
    import gc

    from prism_launch.predict.cost_model import load_cluster, make_cost_model

    model = make_cost_model("nccl", load_cluster(a.cluster))  # no fallback: a missing preset is an error
    t0 = time.perf_counter()
    gc.disable()
    g = build(a.world, a.tp, a.pp, a.microbatches, a.steps, a.layers)
    gc.enable()
    built = time.perf_counter() - t0
    events = sum(len(v) for v in g.ranks.values())
    t0 = time.perf_counter()
    rep = replay(g, model)
    wall = time.perf_counter() - t0
    want = expected_iteration_s(model, a.world, a.tp, a.pp, a.microbatches, a.layers)
    print(f"world {a.world} (TP{a.tp} PP{a.pp} DP{a.world // (a.tp * a.pp)}), {events:,} events "
          f"({events // a.world} per rank), cost model nccl on {a.cluster}")
    print(f"graph build {built:.1f} s | replay {wall:.1f} s | {events / wall:,.0f} events/s")
    print(f"predicted iteration time {rep.iteration_time_s * 1e3:.2f} ms; steps {[round(x * 1e3, 2) for x in rep.iteration_times]}")
    print(f"1F1B closed form {want * 1e3:.2f} ms ({100 * (rep.iteration_time_s - want) / want:+.2f}%)")
    print(f"critical path segments {len(rep.critical_path)}; top straggler {rep.stragglers[:1]}")
    print(f"flows on shared links {rep.flows:,}, slowed by another flow {rep.slowed_flows:,}")
    return report(figures(rep.iteration_time_s, want, events / wall))


if __name__ == "__main__":
    sys.exit(main())
