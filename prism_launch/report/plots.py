"""What a prediction looks like: the Perfetto/Chrome timeline (one process per target node,
one thread per rank) and the PNG plots (predicted step time per rank, one steady-state iteration
of the sandbox's pipeline: :mod:`prism_launch.report.pipeline_view`)."""

from __future__ import annotations

import json
from pathlib import Path

from prism_launch.trace import ReportLayout


def write(out: ReportLayout, prediction: dict, gpus_per_node: int) -> None:
    """The timeline and plots of ``prediction`` (what :func:`prism_launch.predict.prediction.predict` returns)."""
    rep = prediction["replay"]
    out.root.mkdir(parents=True, exist_ok=True)
    _write_timeline(out.timeline, rep.timelines, gpus_per_node)
    _plot(out, prediction["ranks"])
    _plot_pipeline(out, pipeline_of(prediction))


def pipeline_of(prediction: dict):
    """The pipeline picture's data (:func:`prism_launch.report.pipeline_view.pipeline_view`) of a prediction."""
    from prism_launch.report.pipeline_view import pipeline_view

    rep, pipeline = prediction["replay"], prediction["pipeline_ranks"]
    if rep.issue_times is None or "rows" not in prediction:
        return [], (0.0, 0.0)
    field = "compute_cpu_s" if prediction.get("compute_clock") == "cpu" else "compute_wall_s"
    rows = {r: [] for r in pipeline}
    for row in prediction["rows"]:
        if row["rank"] in rows:
            rows[row["rank"]].append(row)
    for evs in rows.values():
        evs.sort(key=lambda e: e["idx"])
    spans = {r: [e[field] or 0.0 for e in evs] for r, evs in rows.items()}
    return pipeline_view(pipeline, rows, spans, rep.issue_times,
                         {r: rep.ranks[r].step_ends for r in pipeline if r in rep.ranks}, rep.timelines)


def _plot_pipeline(out: ReportLayout, view) -> None:
    """One steady-state iteration per pipeline stage: labelled micro-batches, bubble, exposed communication."""
    stages, (lo, hi) = view
    if not stages:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.6 * len(stages)))
    colors = {"F": "tab:green", "B": "tab:blue", "": "tab:olive"}
    for y, st in enumerate(stages):
        for b in st.blocks:
            ax.broken_barh([((a - lo) * 1e3, (z - a) * 1e3) for a, z in b.segments], (y - 0.4, 0.8),
                           color=colors.get(b.label[:1], "tab:olive"), edgecolor="white", lw=0.5)
            if b.label:
                ax.text((b.label_at - lo) * 1e3, y, b.label, ha="center", va="center", fontsize=7,
                        color="white", clip_on=True)
        for kind, t0, t1 in st.waits:
            ax.broken_barh([((t0 - lo) * 1e3, (t1 - t0) * 1e3)], (y - 0.25, 0.5),
                           color="lightgray" if kind == "bubble" else "tab:orange")
    ax.set_yticks(range(len(stages)), [f"stage {s.stage} (rank {s.rank})" for s in stages])
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) * 1e3)
    ax.set_xlabel("ms into one steady-state iteration  green: forward (F), blue: backward (B), "
                  "gray: pipeline bubble, orange: exposed communication")
    ax.set_title("Pipeline of the sandbox rank: one steady-state iteration (predicted)")
    fig.tight_layout()
    fig.savefig(out.pipeline_png, dpi=110)
    plt.close(fig)


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


def _plot(out: ReportLayout, ranks: dict) -> None:
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
