"""The network model against published nccl-tests figures of H100/H200 (and A100) systems.

    python bench/nccl_fit.py [--data bench/data/nccl_tests_published.json] [--max-error 0.10]

``bench/data/nccl_tests_published.json`` holds one row per published bus bandwidth (system,
op, algorithm, nodes, GPUs, nccl-tests size, busbw) with the page it was read from and the
figure as quoted. Each system names a cluster preset and the cluster fields fitted to it.
Rows of one system, op, algorithm and node count at four or more sizes form a series: its
sizes alternate between fitting (even positions, smallest first) and held out (odd
positions). The fitted fields minimise the mean squared log error of the model's bus
bandwidth (:class:`~prism_launch.predict.cost_model.NcclCostModel`, the cluster's latencies
unchanged) over the fitting rows of that system; every other row — the held-out half of each
series and every single quoted figure — only checks. No field is fitted to one row.

Prints a table (source, op, nodes, size, published, predicted, error), the fitted fields per
system, and the mean absolute relative error of the held-out rows; exits 1 when that error
exceeds ``--max-error`` (10%), when a required (op, node count) cell has no held-out figure
of an H100/H200 system, or when fewer than three sources are cited.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prism_launch.predict.cost_model import (  # noqa: E402
    ClusterSpec,
    NcclCostModel,
    bus_bandwidth_gbps,
    load_cluster,
)

DATA = Path(__file__).resolve().parent / "data" / "nccl_tests_published.json"
GPU_KINDS = ("H100", "H200")
"""Systems whose rows count toward the required coverage (the prediction's target GPUs)."""


@dataclass(frozen=True)
class Row:
    system: str
    op: str
    algorithm: str
    nodes: int
    gpus: int
    size_bytes: int
    busbw_gbps: float
    source: str
    quote: str
    role: str = "check"
    """``fit`` (fits its system's fields) or ``check`` (held out)."""


@dataclass(frozen=True)
class System:
    name: str
    preset: str
    note: str
    fit: tuple[str, ...]
    overrides: dict


def load(path: Path = DATA) -> tuple[dict[str, System], dict, list[Row]]:
    """The data file: systems, required coverage, rows (with their fit/check role)."""
    raw = json.loads(path.read_text())
    systems = {k: System(k, v["preset"], v.get("note", ""), tuple(v.get("fit", ())), v.get("overrides", {}))
               for k, v in raw["systems"].items()}
    rows = []
    for r in raw["rows"]:
        if r["system"] not in systems:
            raise ValueError(f"row {r} names an unknown system {r['system']!r} (add it under 'systems')")
        rows.append(Row(**{f.name: r[f.name] for f in dataclasses.fields(Row) if f.name in r}))
    return systems, raw["required"], split(rows)


def split(rows: list[Row]) -> list[Row]:
    """Alternate sizes of each series (>= 4 sizes) between fitting and held out."""
    series: dict[tuple, list[Row]] = {}
    for r in rows:
        series.setdefault((r.system, r.op, r.algorithm, r.nodes), []).append(r)
    out = []
    for members in series.values():
        members.sort(key=lambda r: r.size_bytes)
        if len(members) >= 4:
            out += [dataclasses.replace(r, role="fit" if i % 2 == 0 else "check") for i, r in enumerate(members)]
        else:
            out += members
    return out


# --------------------------------------------------------------------------- model side


def with_fields(cluster: ClusterSpec, values: dict[str, object]) -> ClusterSpec:
    """``cluster`` with dotted fields (``intra_node.half_size_mib``) set."""
    top: dict[str, object] = {}
    nested: dict[str, dict[str, object]] = {}
    for name, v in values.items():
        if "." in name:
            head, tail = name.split(".", 1)
            nested.setdefault(head, {})[tail] = v
        else:
            top[name] = v
    for head, fields in nested.items():
        top[head] = dataclasses.replace(getattr(cluster, head), **fields)
    return dataclasses.replace(cluster, **top)


def get_field(cluster: ClusterSpec, name: str) -> float:
    obj = cluster
    for part in name.split("."):
        obj = getattr(obj, part)
    return float(obj)


def predict_busbw(cluster: ClusterSpec, row: Row) -> float:
    """The model's nccl-tests bus bandwidth for ``row``'s op, group and size."""
    p = row.gpus
    if p != row.nodes * cluster.gpus_per_node:
        raise ValueError(f"row {row.system}/{row.op}: {p} GPUs on {row.nodes} nodes does not match "
                         f"{cluster.gpus_per_node} GPUs per node of {cluster.name}")
    nbytes = row.size_bytes // p if row.op in ("all_gather", "gather") else row.size_bytes
    est = NcclCostModel(cluster).estimate(row.op, nbytes, range(p),
                                          algorithm=None if row.algorithm == "auto" else row.algorithm)
    return bus_bandwidth_gbps(row.op, nbytes, p, est.seconds)


def _loss(cluster: ClusterSpec, rows: list[Row]) -> float:
    return sum(math.log(predict_busbw(cluster, r) / r.busbw_gbps) ** 2 for r in rows) / len(rows)


_START = {"half_size_mib": 8.0, "curve_exponent": 1.0}
_BOUNDS = {"curve_exponent": (0.2, 4.0), "half_size_mib": (1e-3, 1e5)}


def fit_fields(cluster: ClusterSpec, names: tuple[str, ...], rows: list[Row]) -> ClusterSpec:
    """Fit ``names`` (positive fields) to ``rows``: pattern search on the log of each field."""
    if not names or not rows:
        return cluster
    x = []
    for n in names:
        v = get_field(cluster, n)
        x.append(math.log(v if v > 0 else _START.get(n.rsplit(".", 1)[-1], 1.0)))

    def build(xs):
        vals = {}
        for n, xi in zip(names, xs):
            lo, hi = _BOUNDS.get(n.rsplit(".", 1)[-1], (1e-6, 1e9))
            vals[n] = min(hi, max(lo, math.exp(xi)))
        return with_fields(cluster, vals)

    best = _loss(build(x), rows)
    step = 0.5
    while step > 1e-3:
        improved = False
        for i in range(len(x)):
            for sign in (1, -1):
                trial = list(x)
                trial[i] += sign * step
                loss = _loss(build(trial), rows)
                if loss < best - 1e-12:
                    x, best, improved = trial, loss, True
        if not improved:
            step /= 2
    return build(x)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Result:
    rows: list[tuple[Row, float]]
    fitted: dict[str, ClusterSpec]
    held_out_error: float
    missing: list[str]
    sources: int


def node_class(nodes: int) -> str:
    return "1" if nodes == 1 else "2" if nodes == 2 else ">=16" if nodes >= 16 else f"{nodes}"


def evaluate(systems: dict[str, System], required: dict, rows: list[Row]) -> Result:
    """Fit every system's fields on its fitting rows, then predict every row."""
    fitted = {}
    for name, sysm in systems.items():
        base = with_fields(load_cluster(sysm.preset), sysm.overrides)
        fitted[name] = fit_fields(base, sysm.fit, [r for r in rows if r.system == name and r.role == "fit"])
    out = [(r, predict_busbw(fitted[r.system], r)) for r in rows]
    held = [abs(pred / r.busbw_gbps - 1) for r, pred in out if r.role == "check"]
    have = {(r.op, node_class(r.nodes)) for r, _ in out if r.role == "check"
            and any(k in systems[r.system].note for k in GPU_KINDS)}
    missing = [f"{op} on {n} node(s)" for op in required["ops"] for n in required["nodes"] if (op, n) not in have]
    sources = len({r.source for r in rows})
    if sources < required.get("min_sources", 3):
        missing.append(f"sources: {sources} cited, {required.get('min_sources', 3)} required")
    return Result(out, fitted, sum(held) / len(held) if held else math.inf, missing, sources)


def report(systems: dict[str, System], res: Result, max_error: float) -> int:
    print(f"{'source':<58} {'system':<17} {'op':<15} {'algo':<5} {'nodes':>5} {'size':>9} "
          f"{'published':>9} {'predicted':>9} {'error':>8}  role")
    for r, pred in res.rows:
        src = r.source.replace("https://github.com/", "")[:58]
        size = f"{r.size_bytes / 2**20:.0f}M" if r.size_bytes < 2**30 else f"{r.size_bytes / 2**30:.0f}G"
        print(f"{src:<58} {r.system:<17} {r.op:<15} {r.algorithm:<5} {r.nodes:>5} {size:>9} "
              f"{r.busbw_gbps:>9.2f} {pred:>9.2f} {pred / r.busbw_gbps - 1:>+8.1%}  {r.role}")
    print("\nfitted fields (fit rows only):")
    for name, sysm in systems.items():
        vals = ", ".join(f"{n}={get_field(res.fitted[name], n):.4g}" for n in sysm.fit) or "(none: preset as is)"
        print(f"  {name:<17} ({sysm.preset}): {vals}")
    n_held = sum(1 for r, _ in res.rows if r.role == "check")
    ok_err = res.held_out_error <= max_error
    print(f"\nheld-out rows: {n_held}; mean absolute error {res.held_out_error:.1%} "
          f"(goal <= {max_error:.0%}: {'met' if ok_err else 'MISSED'}); sources cited: {res.sources}")
    if res.missing:
        print("missing published figures (required, none found yet): " + "; ".join(res.missing))
    return 0 if ok_err and not res.missing else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--max-error", type=float, default=0.10)
    a = ap.parse_args(argv)
    systems, required, rows = load(a.data)
    return report(systems, evaluate(systems, required, rows), a.max_error)


if __name__ == "__main__":
    sys.exit(main())
