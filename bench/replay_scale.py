"""Global replay throughput at scale: a synthetic TP·PP·DP Megatron-like graph (1F1B
pipeline with tensor-parallel all-reduces and a data-parallel gradient all-reduce per step)
of WORLD ranks, replayed with the NCCL-like cost model of an H100 InfiniBand cluster.

    python bench/replay_scale.py [--world 8192] [--tp 8] [--pp 4] [--microbatches 8] [--steps 4]

Prints events, wall time and events/s; the goal is an 8,192-rank graph with thousands of
events per rank in under 60 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import time

from prism_launch.predict.simulate import COLL, MARK, RECV, SEND, WAIT, Graph, replay


class _Flat:
    def collective_time(self, kind, nbytes, ranks):
        return 1e-5 + nbytes / 100e9

    def p2p_time(self, nbytes, src, dst):
        return 1e-5 + nbytes / 50e9


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
                evs.append((SEND, 0.0, key, 1 << 20))
                evs.append((WAIT, 0.0, ("s", key), None))
            else:
                evs.append((RECV, 0.0, key, None))
                evs.append((WAIT, 0.0, ("r", key), None))

        def tp_layer(span):
            nonlocal seq_tp
            for _ in range(layers):
                key = ("c", 10_000 + r // tp, seq_tp)
                evs.append((COLL, span, key, ("all_reduce", 1 << 21, tp_group)))
                evs.append((WAIT, 0.0, key, None))
                seq_tp += 1

        for step in range(steps):
            for _mb in range(microbatches):  # all-forward-all-backward keeps the sketch short
                if prev is not None:
                    p2p("recv", prev, r)
                tp_layer(2e-4)
                if nxt is not None:
                    p2p("send", r, nxt)
            for _mb in range(microbatches):
                if nxt is not None:
                    p2p("recv", nxt, r)
                tp_layer(4e-4)
                if prev is not None:
                    p2p("send", r, prev)
            key = ("c", 20_000 + p * tp + t, seq_dp)
            evs.append((COLL, 1e-4, key, ("all_reduce", 1 << 26, dp_group)))
            evs.append((WAIT, 0.0, key, None))
            seq_dp += 1
            evs.append((MARK, 1e-3, step, None))
        ranks[r] = evs
    return Graph(ranks=ranks, world_size=world)


def main() -> None:
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

    t0 = time.perf_counter()
    gc.disable()
    g = build(a.world, a.tp, a.pp, a.microbatches, a.steps, a.layers)
    gc.enable()
    built = time.perf_counter() - t0
    try:
        from prism_launch.predict.cost_model import load_cluster, make_cost_model

        model = make_cost_model("nccl", load_cluster(a.cluster))
        model_name = f"nccl on {a.cluster}"
    except Exception:  # noqa: BLE001 - bench still runs without the cluster presets
        model, model_name = _Flat(), "flat"
    events = sum(len(v) for v in g.ranks.values())
    t0 = time.perf_counter()
    rep = replay(g, model)
    wall = time.perf_counter() - t0
    print(f"world {a.world} (TP{a.tp} PP{a.pp} DP{a.world // (a.tp * a.pp)}), {events:,} events "
          f"({events // a.world} per rank), cost model {model_name}")
    print(f"graph build {built:.1f} s | replay {wall:.1f} s | {events / wall:,.0f} events/s")
    print(f"predicted iteration time {rep.iteration_time_s * 1e3:.2f} ms; steps {[round(x * 1e3, 2) for x in rep.iteration_times]}")
    print(f"critical path segments {len(rep.critical_path)}; top straggler {rep.stragglers[:1]}")


if __name__ == "__main__":
    main()
