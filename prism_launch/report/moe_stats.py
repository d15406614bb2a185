"""MoE routing statistics from a PrismTrace: tokens per expert and per EP rank, per step and
overall, all-to-all bytes, dropped tokens, and what the imbalance costs in the global replay.

Reads the trace only. Which collectives are token dispatches is framework knowledge: the
module of the integration named by ``integration.moe`` (default ``megatron``, or the recipe's own
integration where it has a detector: :func:`prism_launch.config.registry.choose_moe`) exposes
``find_dispatches(rows, groups, read_tensor, script_args)``; this module aggregates what it
finds. The report's ``moe`` section:

- ``overall`` / ``per_step``: tokens routed to each expert (summed over layers, micro-batches
  and data-parallel replicas), ``expert_imbalance`` = max / mean tokens per expert,
  ``ep_rank_imbalance`` = max / mean tokens received per EP rank (each rank of an EP group, the
  device load), dropped tokens;
  ``*_cv`` the coefficients of variation (standard deviation / mean);
- ``per_dispatch``: the same max / mean for each single dispatch (one layer, one micro-batch);
- ``per_layer``: tokens per expert of each MoE layer of each stage (the i-th dispatch of a forward
  pass on an EP group is layer i of that stage);
- ``per_rank``: per step, tokens received and sent, all-to-all bytes sent, dropped tokens;
- ``effect``: a global replay with timelines for the EP ranks; the exposed all-to-all wait
  per iteration on the most loaded EP rank vs the mean. The most loaded rank computes longest
  and the others wait for it at the all-to-alls: ``a2a_wait_excess_s`` (mean wait minus the
  most loaded rank's wait) is the time the imbalance adds to each iteration;
- ``plot``: ``moe_expert_load.png`` beside the report, tokens per expert over steps.

The counts come from the events (kept by value in every payload mode), so the section is there
for ``exact`` and ``none`` traces alike; of a folded capture they are the captured ranks'.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from prism_launch.config import registry
from prism_launch.trace import TraceLayout

if TYPE_CHECKING:
    from prism_launch.config import PrismConfig
    from prism_launch.trace import TraceReader


def _ratio(values) -> float | None:
    values = list(values)
    if not values:
        return None
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


def _cv(values) -> float | None:
    """Coefficient of variation (population standard deviation / mean)."""
    values = list(values)
    if not values:
        return None
    mean = sum(values) / len(values)
    return statistics.pstdev(values) / mean if mean > 0 else None


def _per_layer(dispatches: list[dict], E: int) -> list[dict]:
    """Tokens per expert of each MoE layer of each stage (dispatches grouped by their EP group's
    first rank and their layer index), summed over steps and micro-batches."""
    load: dict[tuple[int, int], list[int]] = {}
    for d in dispatches:
        if d.get("layer") is None:
            continue
        first = min(next(iter(d["ep_group"].values())))
        tpe = load.setdefault((first, d["layer"]), [0] * E)
        for c in d["counts"].values():
            for e, n in enumerate(c):
                tpe[e] += n
    return [{"ep_group_first_rank": g, "layer": layer, "tokens_per_expert": tpe,
             "expert_imbalance": _ratio(tpe), "expert_cv": _cv(tpe)}
            for (g, layer), tpe in sorted(load.items())]


def aggregate(found: dict, rows: list[dict]) -> dict | None:
    """Statistics from the detector's dispatches (see module doc); None when there are none."""
    dispatches = found.get("dispatches") or []
    if not dispatches:
        return None
    E = max(d["num_experts"] for d in dispatches)
    step_experts: dict[int, list[int]] = defaultdict(lambda: [0] * E)
    recv: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))   # unit -> rank -> tokens
    sent: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    dropped: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    dropped_known = True
    per_dispatch, verified, ep_sizes = [], 0, set()
    routed: dict[int, list[int]] = defaultdict(lambda: [0] * E)   # rank -> tokens it routed to each expert
    derived = {m for d in dispatches for m in d.get("derived", ())}
    for d in dispatches:
        u, counts = d["unit"], d["counts"]
        tpe = [sum(c[e] for c in counts.values()) for e in range(d["num_experts"])]
        for e, n in enumerate(tpe):
            step_experts[u][e] += n
        per_dispatch.append(_ratio(tpe))
        ok = d.get("verified", True)  # a detector's own check where the all-to-all sizes say nothing
        for m, c in counts.items():
            group = d["ep_group"][m]
            ep_sizes.add(len(group))
            L = d["num_experts"] // len(group)
            j = group.index(m)
            recv[u][m] += sum(sum(counts[s][j * L:(j + 1) * L]) for s in group if s in counts)
            sent[u][m] += sum(c)
            for e, n in enumerate(c):
                routed[m][e] += n
            if m in d["splits"] and d["splits"][m] != [sum(c[k * L:(k + 1) * L]) for k in range(len(group))]:
                ok = False
            if d.get("pre_drop") is not None:
                dropped[u][m] += sum(d["pre_drop"][m]) - sum(c)
            elif d.get("pre_drop_total") is not None:
                dropped[u][m] += d["pre_drop_total"][m] - sum(c)
            else:
                dropped_known = False
        verified += ok
    a2a_bytes: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for row in rows:
        if row["kind"] == "collective" and row.get("extra") and '"all_to_all"' in row["extra"]:
            a2a_bytes[row["unit"]][row["rank"]] += int(row["nbytes"])
    units = sorted(step_experts)
    ranks = sorted({r for u in units for r in recv[u]})
    per_step = []
    for u in units:
        per_step.append({
            "step": u,
            "tokens_per_expert": step_experts[u],
            "expert_imbalance": _ratio(step_experts[u]),
            "expert_cv": _cv(step_experts[u]),
            "ep_rank_imbalance": _ratio(recv[u][r] for r in ranks),
            "ep_rank_cv": _cv(recv[u][r] for r in ranks),
            "dropped_tokens": sum(dropped[u].values()) if dropped_known else None,
            "a2a_bytes": sum(a2a_bytes[u].values()),
        })
    total_experts = [sum(step_experts[u][e] for u in units) for e in range(E)]
    total_recv = {r: sum(recv[u][r] for u in units) for r in ranks}
    valid = [x for x in per_dispatch if x is not None]
    return {
        "detector_notes": found.get("notes", []),
        "dropped_source": found.get("dropped_source"),
        "num_experts": E,
        "ep_sizes": sorted(ep_sizes),
        "dispatches": len(dispatches),
        "dispatches_verified": verified,
        "ranks_counted": len(ranks),
        "overall": {
            "tokens_per_expert": total_experts,
            "hottest_expert": max(range(E), key=lambda e: (total_experts[e], -e)),
            "expert_imbalance": _ratio(total_experts),
            "expert_cv": _cv(total_experts),
            "ep_rank_imbalance": _ratio(total_recv.values()),
            "ep_rank_cv": _cv(total_recv.values()),
            "tokens_per_ep_rank": {str(r): n for r, n in total_recv.items()},
            "dropped_tokens": sum(sum(dropped[u].values()) for u in units) if dropped_known else None,
            "routed_tokens": sum(total_experts),
            "a2a_bytes": sum(sum(v.values()) for v in a2a_bytes.values()),
        },
        "per_dispatch": {"expert_imbalance_mean": statistics.fmean(valid) if valid else None,
                         "expert_imbalance_max": max(valid) if valid else None},
        "per_step": per_step,
        "per_layer": _per_layer(dispatches, E),
        "per_rank": {str(r): {"steps": units, "derived": r in derived, "tokens_per_expert": routed[r],
                              "received_tokens": [recv[u][r] for u in units],
                              "sent_tokens": [sent[u][r] for u in units],
                              "a2a_bytes": [a2a_bytes[u][r] for u in units],
                              "dropped_tokens": [dropped[u][r] for u in units] if dropped_known else None}
                     for r in ranks},
    }


# -- effect on the predicted iteration time ------------------------------------------------------


def exposed_waits(events: list[tuple], timeline: list[tuple[str, float, float]], keys: set) -> list[tuple[float, float]]:
    """Per iteration (between step markers): ``(exposed wait on ops in keys, compute)`` of one
    rank, matched from the replay's timeline (compute spans and exposed waits, in order)."""
    from prism_launch.predict.simulate import MARK, WAIT

    segs = [[0.0, 0.0]]
    i, t = 0, 0.0
    for code, span, key, _info in events:
        if span > 0 and i < len(timeline) and timeline[i][0] == "compute":
            t = timeline[i][2]
            segs[-1][1] += span
            i += 1
        if code == WAIT and i < len(timeline) and timeline[i][0] != "compute" \
                and math.isclose(timeline[i][1], t, rel_tol=1e-12, abs_tol=1e-15):
            if key in keys:
                segs[-1][0] += timeline[i][2] - timeline[i][1]
            t = timeline[i][2]
            i += 1
        elif code == MARK:
            segs.append([0.0, 0.0])
    return [tuple(s) for s in segs]


def _steady(segs: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean per iteration over the segments between step markers (after the first)."""
    body = segs[1:-1] if len(segs) > 2 else segs[:1]
    return (statistics.fmean(s[0] for s in body), statistics.fmean(s[1] for s in body))


def effect(cfg: PrismConfig, reader: TraceReader, trace: TraceLayout | None, tokens: dict[int, int]) -> dict:
    from prism_launch.predict.cost_model import make_cost_model
    from prism_launch.predict.prediction import graph_source
    from prism_launch.predict.simulate import graph_from_events, replay

    rd, _source, compute = graph_source(cfg, reader, trace) if trace is not None else (reader, "", "cpu")
    rows = rd.events().to_pylist()
    groups = {int(g["id"]): tuple(g["ranks"]) for g in rd.manifest.groups}
    graph = graph_from_events(rows, groups, rd.manifest.world_size, compute=compute)
    ranks = sorted(r for r in tokens if r in graph.ranks)
    rep = replay(graph, make_cost_model(cfg.replay.cost_model, cfg.cluster), timeline_ranks=ranks,
                 comm_on_cores=cfg.cluster.comm_on_cores)
    keys = {("c", row["group"], row["seq"]) for row in rows
            if row["kind"] == "collective" and row.get("extra") and '"all_to_all"' in row["extra"]}
    per_rank = {}
    for r in ranks:
        wait, compute = _steady(exposed_waits(graph.ranks[r], rep.timelines.get(r, []), keys))
        per_rank[r] = {"tokens": tokens[r], "a2a_wait_s": wait, "compute_s": compute}
    if not per_rank:
        return {}
    most = max(per_rank, key=lambda r: (per_rank[r]["tokens"], -r))
    waits = [v["a2a_wait_s"] for v in per_rank.values()]
    mean_wait = statistics.fmean(waits)
    return {
        "iteration_time_s": rep.iteration_time_s,
        "most_loaded_rank": most,
        "most_loaded_tokens": per_rank[most]["tokens"],
        "mean_tokens": statistics.fmean(v["tokens"] for v in per_rank.values()),
        "a2a_wait_s": {"most_loaded": per_rank[most]["a2a_wait_s"], "mean": mean_wait,
                       "max": max(waits), "min": min(waits)},
        "a2a_wait_excess_s": mean_wait - per_rank[most]["a2a_wait_s"],
        "compute_s": {"most_loaded": per_rank[most]["compute_s"],
                      "mean": statistics.fmean(v["compute_s"] for v in per_rank.values())},
        "per_rank": {str(r): v for r, v in per_rank.items()},
        "note": "per iteration (steady state) in the global replay; a2a_wait_excess_s: how much longer the "
                "average EP rank waits at all-to-alls than the most loaded one",
    }


def _ep_completion(fold: dict | None):
    """For an EP-folded trace: every member's counts of a count all-gather, the uncaptured
    members' derived as the capture derived them (:func:`prism_launch.capture.ep_fold.derived_counts`)."""
    if not fold or not fold.get("ep_positions"):
        return None
    from prism_launch.capture.ep_fold import derived_counts
    from prism_launch.trace.fold import FoldPlan

    plan = FoldPlan.from_dict(fold)

    def complete(members: list[int], present: dict[int, list[int]]) -> dict[int, list[int]] | None:
        sources = plan.sources(members)
        if sources is None or any(s not in present for s in sources):
            return None
        return derived_counts(present, members, dict(zip(members, sources)))

    return complete


PLOT = "moe_expert_load.png"
"""The report's plot of tokens per expert over steps (beside ``report.json``)."""


def plot_expert_load(moe: dict, path: Path) -> None:
    """Tokens routed to each expert per step (a heat map) and max/mean per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in moe["per_step"]]
    load = [[s["tokens_per_expert"][e] for s in moe["per_step"]] for e in range(moe["num_experts"])]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(6.0, 0.4 * len(steps) + 4), 7), height_ratios=[3, 1],
                                  sharex=True)
    im = ax.imshow(load, aspect="auto", origin="lower", interpolation="nearest",
                   extent=(min(steps) - 0.5, max(steps) + 0.5, -0.5, moe["num_experts"] - 0.5))
    fig.colorbar(im, ax=ax, label="tokens routed")
    ax.set_ylabel("expert")
    ax.set_title(f"MoE expert load per step ({moe['ranks_counted']} ranks' routers)")
    ax2.plot(steps, [s["expert_imbalance"] or 0 for s in moe["per_step"]], marker="o", label="experts max/mean")
    ax2.plot(steps, [s["ep_rank_imbalance"] or 0 for s in moe["per_step"]], marker="s", label="EP ranks max/mean")
    ax2.set_xlabel("step")
    ax2.set_ylabel("max / mean")
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


AUX_PREFERRED = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "l_aux")
"""The auxiliary loss a sweep's ``moe_aux_loss`` column shows, first found first (megatron-core's
names, then DeepSpeed's gate loss); else whichever the routers recorded."""


def moe_stats(cfg: PrismConfig, reader: TraceReader, trace: TraceLayout | None = None,
              plot_dir: Path | None = None) -> dict | None:
    """The report's ``moe`` section, or None when the trace has no MoE token dispatch; with
    ``plot_dir`` also the expert-load plot there (:data:`PLOT`)."""
    script_args = list(reader.manifest.extra.get("script_args") or [])
    name = registry.choose_moe(cfg.integration.moe, script_args)
    if not name:
        return None
    detector = registry.load(name, "moe", where="integration.moe")
    rows = reader.events().to_pylist()
    groups = {int(g["id"]): tuple(g["ranks"]) for g in reader.manifest.groups}
    fold = reader.read_json(TraceLayout.FOLD) if TraceLayout.FOLD in reader.json_files() else None
    found = detector.find_dispatches(rows, groups, reader.tensor,
                                     script_args=script_args,
                                     complete=_ep_completion(fold))
    stats = aggregate(found, rows)
    if stats is None:
        if found.get("notes"):  # dispatches there, but not every member's counts are in the trace
            return {"error": f"{'; '.join(found['notes'])}: a trace recorded before token counts were kept "
                             "by value in every payload mode; capture it again for MoE routing statistics"}
        return None
    stats["detector"] = name
    stats["aux_losses"] = found.get("aux_losses") or {}
    main_loss = next((n for n in AUX_PREFERRED if n in stats["aux_losses"]), next(iter(stats["aux_losses"]), None))
    stats["overall"]["aux_loss"] = None if main_loss is None else stats["aux_losses"][main_loss]["mean"]
    stats["overall"]["aux_loss_name"] = main_loss
    stats["payload"] = reader.manifest.extra.get("payload")
    stats["counts_source"] = found.get("counts_source") or (
        "every captured rank's routed-token counts, recorded by value in every payload mode "
        "(extra.ints of the count collectives)")
    if fold is not None:
        derived = sorted({m for d in found["dispatches"] for m in d.get("derived", ())})
        stats["fold"] = {"captured_ranks": len(fold["captured"]), "world_size": fold["world_size"],
                         "ep_positions": fold.get("ep_positions", []), "ep_ranks_derived": len(derived),
                         "ep_fold": fold.get("ep_fold"),
                         "note": ("EP-folded: uncaptured EP ranks' counts are the captured routers' tokens per expert at "
                                  "each dispatch, apportioned over their own token count (as the capture gave them); "
                                  "all-to-all pieces between captured ranks exact, those from uncaptured ones "
                                  "synthesized" if fold.get("ep_positions") else
                                  "counts of the captured ranks' routers; an uncaptured rank routes as the captured "
                                  "stand-in it mirrors")}
    if plot_dir is not None:
        plot_dir.mkdir(parents=True, exist_ok=True)
        plot_expert_load(stats, plot_dir / PLOT)
        stats["plot"] = PLOT
    if trace is not None:
        tokens = {int(r): n for r, n in stats["overall"]["tokens_per_ep_rank"].items()}
        stats["effect"] = effect(cfg, reader, trace, tokens)
    return stats


def print_moe(moe: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(file=sys.stderr, highlight=False)
    table = Table(title=f"MoE routing ({moe['num_experts']} experts, EP {moe['ep_sizes']}, "
                        f"{moe['dispatches']} dispatches)", title_justify="left")
    for name in ("step", "tokens/expert max/mean", "CV", "tokens/EP rank max/mean", "CV", "dropped",
                 "all-to-all MiB"):
        table.add_column(name, justify="right")

    def fmt(v, spec=".3f"):
        return "" if v is None else format(v, spec)

    for s in moe["per_step"]:
        table.add_row(str(s["step"]), fmt(s["expert_imbalance"]), fmt(s.get("expert_cv")), fmt(s["ep_rank_imbalance"]),
                      fmt(s.get("ep_rank_cv")), "" if s["dropped_tokens"] is None else str(s["dropped_tokens"]),
                      f"{s['a2a_bytes'] / 2**20:.2f}")
    o = moe["overall"]
    table.add_row("all", fmt(o["expert_imbalance"]), fmt(o.get("expert_cv")), fmt(o["ep_rank_imbalance"]),
                  fmt(o.get("ep_rank_cv")),
                  "n/a" if o["dropped_tokens"] is None else str(o["dropped_tokens"]), f"{o['a2a_bytes'] / 2**20:.2f}",
                  style="bold")
    console.print(table)
    pd = moe["per_dispatch"]
    console.print(f"  per dispatch (layer x micro-batch): tokens/expert max/mean {fmt(pd['expert_imbalance_mean'])} "
                  f"on average, {fmt(pd['expert_imbalance_max'])} at worst; dropped tokens: "
                  f"{moe.get('dropped_source') or 'not derivable'}")
    layers = moe.get("per_layer") or []
    if layers:
        worst = max(layers, key=lambda x: x["expert_imbalance"] or 0)
        console.print(f"  per layer: {len(layers)} (stage, layer) pairs; most imbalanced: layer {worst['layer']} of "
                      f"the stage whose EP group starts at rank {worst['ep_group_first_rank']}, tokens/expert "
                      f"max/mean {fmt(worst['expert_imbalance'])}; hottest expert overall: {o.get('hottest_expert')}")
    aux = moe.get("aux_losses") or {}
    if aux:
        console.print("  routers' auxiliary losses (before their coefficient; mean over the captured ranks' router "
                      "calls): " + "; ".join(f"{n} {fmt(v['mean'], '.4g')} ({v['calls']} calls, {v['ranks']} ranks, "
                                              f"steps {' '.join(fmt(x['mean'], '.4g') for x in v['per_step'])})"
                                              for n, v in aux.items()))
    elif moe.get("aux_losses") is not None:
        console.print("  routers' auxiliary losses: none recorded (no aux loss configured, or a trace captured "
                      "before they were kept)")
    eff = moe.get("effect") or {}
    if eff:
        w = eff["a2a_wait_s"]
        excess = eff["a2a_wait_excess_s"]
        verdict = (f"the others wait {excess * 1e3:.2f} ms longer for it" if excess > 0 else
                   "no measurable cost (it does not wait less than the mean)")
        console.print(f"  effect on the {eff['iteration_time_s'] * 1e3:.2f} ms iteration: most loaded EP rank "
                      f"{eff['most_loaded_rank']} ({eff['most_loaded_tokens']} tokens vs {eff['mean_tokens']:.0f} mean) "
                      f"computes {eff['compute_s']['most_loaded'] * 1e3:.2f} ms vs {eff['compute_s']['mean'] * 1e3:.2f} ms "
                      f"mean and waits {w['most_loaded'] * 1e3:.2f} ms at all-to-alls vs {w['mean'] * 1e3:.2f} ms mean: "
                      f"{verdict}")
    for note in moe.get("detector_notes", []):
        console.print(f"  note: {note}")


def main(argv: list[str] | None = None) -> int:
    """``python -m prism_launch.report.moe_stats TRACE_DIR [key=value ...]``: the MoE section of a trace."""
    import argparse

    from prism_launch.config import compose, resolve
    from prism_launch.trace import TraceReader

    p = argparse.ArgumentParser(prog="python -m prism_launch.report.moe_stats")
    p.add_argument("trace_dir")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    cfg = resolve(compose(a.overrides))
    stats = moe_stats(cfg, TraceReader(Path(a.trace_dir)), TraceLayout(Path(a.trace_dir)))
    if stats is None or "error" in stats:
        print(stats["error"] if stats else "no MoE token dispatch in this trace", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in stats.items() if k not in ("per_rank",)}, indent=1))
    print_moe(stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
