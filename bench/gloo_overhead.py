"""The per-op software overhead of a gloo collective on this machine, for the ``cpu_local`` model.

    OMP_NUM_THREADS=1 python bench/gloo_overhead.py [--sizes 1K,4K,16K,64K,256K,1M] [--iters 60] [--repeat 3]

netbench (:mod:`prism_launch.predict.netbench`) fits latency per hop and bandwidth with the
launch overhead folded into the per-hop latency: an op of two ranks then costs one hop
(all_gather, broadcast) or two (all_reduce) of it, and gloo's fixed cost of an op — the
call, its work object, waking its threads: the same for every kind — is counted once or
twice depending on the algorithm. Small collectives (ZeRO's buckets) come out under-priced.
Here the times of all_reduce, all_gather and broadcast at every size are fitted jointly to

    t = overhead + hops(kind) × latency + bytes(kind) / bandwidth

(``hops`` and ``bytes`` as the cost model counts them), weighted by 1/t so small ops count,
``--repeat`` times (the machine's load moves the figures: every fit is printed, the median
is the result). ``overhead`` is ``cluster.protocol_latency_us`` (the cost model's per-op
base), ``latency`` and ``bandwidth`` the link's. It prints the YAML lines to put in
``configs/cluster/cpu_local.yaml``; it never writes the preset itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = ("all_reduce", "all_gather", "broadcast")


def _terms(kind: str, nbytes: int, p: int) -> tuple[float, float]:
    """(hops, seconds per GB/s of bandwidth) of one op as the cost model counts them."""
    from prism_launch.config.cluster import LinkSpec
    from prism_launch.predict.netbench import _model_time

    hops = _model_time(LinkSpec(bandwidth_gbps=1e12, latency_us=1.0), kind, nbytes, p) / 1e-6
    per_bw = _model_time(LinkSpec(bandwidth_gbps=1.0, latency_us=0.0), kind, nbytes, p)
    return round(hops, 6), per_bw


def fit(measured: dict[tuple[str, int], float], p: int) -> tuple[float, float, float]:
    """(overhead µs, latency µs per hop, bandwidth GB/s) of the weighted least-squares fit."""
    import numpy as np

    rows, ys = [], []
    for (kind, n), t in measured.items():
        if kind not in KINDS:
            continue
        hops, per_bw = _terms(kind, n, p)
        rows.append([1.0 / t, hops / t, per_bw / t])  # weighted by 1/t: relative error
        ys.append(1.0)
    x, y = np.array(rows), np.array(ys)
    # the best fit whose terms are all >= 0: all three free, else one of overhead / latency held at 0
    best = None
    for free in ((0, 1, 2), (1, 2), (0, 2)):
        coef, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        full = np.zeros(3)
        full[list(free)] = coef
        if (full >= 0).all():
            err = float(((x @ full - y) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, full)
    if best is None:
        raise ValueError("no fit with a non-negative overhead, latency and bandwidth term")
    a, b, c = best[1]
    return a / 1e-6, b / 1e-6, (1.0 / c if c > 0 else float("inf"))


def fit_kinds(measured: dict[tuple[str, int], float], p: int) -> dict:
    """Each collective kind measured at two or more sizes fitted alone (netbench's per-kind fit,
    :func:`~prism_launch.predict.netbench.fit_measurements`) as ``cluster.kinds`` entries: gloo's
    kinds differ by more than their hops and bytes (its all_reduce of 512 KiB between 2 processes
    on the 2-core VM costs ~1.5 ms, its broadcast ~0.3 ms), which one joint fit averages away."""
    from prism_launch.predict.link_fit import kind_costs
    from prism_launch.predict.netbench import fit_measurements

    return kind_costs(fit_measurements(measured, p))


def kinds_override(kinds: dict) -> str:
    """The ``+cluster.kinds={...}`` override of :func:`fit_kinds`'s figures."""
    body = ",".join(f"{k}:{{latency_us:{c.latency_us},bandwidth_gbps:{c.bandwidth_gbps}}}"
                    for k, c in sorted(kinds.items()))
    return f"+cluster.kinds={{{body}}}"


def main() -> int:
    from prism_launch.predict.netbench import parse_sizes, run_workers

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1K,4K,16K,64K,256K,1M")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    sizes = parse_sizes(a.sizes)
    fits = []
    for i in range(a.repeat):
        measured = run_workers(2, sizes, a.iters, 3, "gloo", 300.0)
        o, lat, bw = fit(measured, 2)
        fits.append((o, lat, bw))
        print(f"run {i + 1}/{a.repeat} (load {os.getloadavg()[0]:.2f}): overhead {o:.1f} us/op, latency {lat:.1f} "
              f"us/hop, bandwidth {bw:.3f} GB/s")
        for (kind, n), t in sorted(measured.items()):
            if kind in KINDS:
                hops, per_bw = _terms(kind, n, 2)
                model = o * 1e-6 + hops * lat * 1e-6 + per_bw / bw
                print(f"  {kind:11} {n:>8} B  measured {t * 1e6:8.1f} us  fit {model * 1e6:8.1f} us "
                      f"({100 * (model - t) / t:+.1f}%)")
    o, lat, bw = (statistics.median(f[k] for f in fits) for k in range(3))
    print(f"\nmedian of {a.repeat}: protocol_latency_us: {o:.1f}; intra_node latency_us: {lat:.1f}, "
          f"bandwidth_gbps: {bw:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
