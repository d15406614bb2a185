"""What a prediction looks like: the Perfetto/Chrome timeline (one process per target node,
one thread per rank) and the PNG plots (predicted step time per rank, the sandbox's pipeline)."""

from __future__ import annotations

import json
from pathlib import Path

from prism_launch.trace import ReportLayout


def write(out: ReportLayout, prediction: dict, gpus_per_node: int) -> None:
    """The timeline and plots of ``prediction`` (what :func:`prism_launch.predict.prediction.predict` returns)."""
    rep = prediction["replay"]
    out.root.mkdir(parents=True, exist_ok=True)
    _write_timeline(out.timeline, rep.timelines, gpus_per_node)
    _plot(out, prediction["ranks"], rep.timelines, prediction["pipeline_ranks"], rep.ranks)


def _write_timeline(path: Path, timelines: dict, gpus_per_node: int) -> None:
    """Chrome/Perfetto trace-event JSON: one process per target node, one thread per rank."""
    events = []
    for r, spans in sorted(timelines.items()):
        node = r // max(1, gpus_per_node)
        events.append({"ph": "M", "name": "process_name", "pid": node, "args": {"name": f"node {node}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": node, "tid": r, "args": {"name": f"rank {r}"}})
        for name, t0, t1 in spans:
            events.append({"ph": "X", "name": name, "pid": node, "tid": r, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6})
    from nccl_ext.core.atomic import atomic_write_text

    atomic_write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _plot(out: ReportLayout, ranks: dict, timelines: dict, pipeline: list[int], results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(int(r) for r in ranks)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ys = [ranks[str(r)]["iteration_time_s"] * 1e3 for r in xs]
    if len(xs) <= 512:
        ax.bar(xs, ys, color=["tab:red" if ranks[str(r)]["sandbox"] else "tab:blue" for r in xs], width=1.0)
    else:  # thousands of ranks: one line instead of one patch per rank
        ax.fill_between(xs, ys, step="mid", color="tab:blue", lw=0)
        sb = [r for r in xs if ranks[str(r)]["sandbox"]]
        ax.scatter(sb, [ranks[str(r)]["iteration_time_s"] * 1e3 for r in sb], color="tab:red", zorder=3, s=12)
    ax.set_xlabel("logical rank (red: sandbox)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("Predicted per-rank iteration time")
    fig.tight_layout()
    fig.savefig(out.step_time_png, dpi=110)
    plt.close(fig)

    shown = [r for r in pipeline if r in timelines]
    if shown:
        fig, ax = plt.subplots(figsize=(11, 0.5 + 0.45 * len(shown)))
        palette = {"compute": "tab:green", "wait": "tab:orange", "p2p-wait": "tab:gray"}
        for y, r in enumerate(shown):
            bars: dict[str, list] = {}
            for name, t0, t1 in timelines[r]:
                bars.setdefault(name, []).append((t0 * 1e3, (t1 - t0) * 1e3))
            for name, xs in bars.items():  # one collection per kind: thousands of spans stay fast
                ax.broken_barh(xs, (y - 0.4, 0.8), color=palette.get(name, "tab:purple"))
            for t in results[r].step_ends:
                ax.axvline(t * 1e3, color="k", lw=0.3)
        ax.set_yticks(range(len(shown)), [f"rank {r}" for r in shown])
        ax.set_xlabel("time (ms)  green: compute, orange: collective wait, gray: pipeline (p2p) wait")
        ax.set_title("Pipeline of the sandbox rank (predicted)")
        fig.tight_layout()
        fig.savefig(out.pipeline_png, dpi=110)
        plt.close(fig)
