"""Config sweeps: ``prism-launch --multirun [torchrun flags] key=a,b ... SCRIPT ARGS``.

Hydra's application machinery runs the sweep (its sweeper expands ``key=a,b`` into points,
its launcher runs them: ``basic`` in-process by default, ``hydra/launcher=joblib`` for local
parallel points, ``submitit_*``/``ray`` configs in ``configs/hydra/launcher``). Each point
composes the typed config, renders ``target.parallel``/``script.args`` into the script's
arguments through the integration named by ``integration.kind`` (before the launcher
fingerprints the trace, so every point has its own), validates, runs the launcher
(``mode=auto`` by default: capture if no trace, then emulate) and returns one row. An invalid
point becomes a row with the reason; a failing one a row with the first line of its error.

After the sweep: ``summary.csv`` (one row per point), ``summary.png`` and a ranked table on
the terminal, in the sweep dir (``hydra.sweep.dir``, default ``multirun/<date>/<time>``);
each point's report lives in ``<sweep dir>/<point>/report``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import gc
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prism_launch.launch.args import LaunchArgs
    from prism_launch.config import PrismConfig

COLUMNS = ("point", "overrides", "status", "rank", "iteration_time_s", "iteration_time_host_kept_up_s", "mfu", "tokens_per_s_per_gpu", "tokens_per_s",
           "model_tflops_per_gpu", "peak_memory_bytes", "oom", "oom_ranks",
           "moe_expert_imbalance", "moe_ep_rank_imbalance", "moe_a2a_wait_excess_s", "moe_dropped_tokens",
           "moe_aux_loss", "world_size", "wall_s", "script_args", "report")


# -- rendering through the integration ------------------------------------------------------


def render_args(cfg: PrismConfig, args: LaunchArgs, out_dir: Path | None = None) -> LaunchArgs:
    """``args`` with ``target.parallel`` and ``script.args`` rendered into the script's arguments
    by the renderer of the integration ``integration.kind`` (:mod:`prism_launch.config.registry`).
    Unchanged when nothing is set. Raises ConfigError for an invalid combination."""
    from prism_launch.config import registry
    from prism_launch.config import ConfigError

    p = cfg.target.parallel
    wanted = any(getattr(p, f.name) is not None for f in dataclasses.fields(p)) or bool(cfg.script.args)
    if not wanted:
        return args
    kind = cfg.integration.kind
    if kind == "none":
        raise ConfigError("target.parallel / script.args are set but integration.kind=none renders nothing")
    module = registry.load(kind, "renderer", where="integration.kind")
    script_args = module.render(cfg, list(args.script_args), out_dir)
    return dataclasses.replace(args, script_args=list(script_args))


# -- one point --------------------------------------------------------------------------------


def summarize_report(report: dict) -> dict:
    """The sweep's columns from one point's ``report.json``."""
    pred = report.get("predicted") or {}
    peaks = [v.get("peak_memory_bytes") for v in (report.get("ranks") or {}).values()
             if v.get("peak_memory_bytes") is not None]
    oom_ranks = pred.get("oom_ranks")
    moe = (report.get("moe") or {}).get("overall") or {}
    effect = (report.get("moe") or {}).get("effect") or {}
    tp = pred.get("throughput") or {}
    return {
        "iteration_time_s": pred.get("iteration_time_s"),
        # a host-bound point's step on a host that keeps up (replay.host_gaps=removed); empty otherwise
        "iteration_time_host_kept_up_s": (pred.get("host_kept_up") or {}).get("iteration_time_s"),
        "mfu": tp.get("mfu"),
        "tokens_per_s_per_gpu": tp.get("tokens_per_s_per_gpu"),
        "tokens_per_s": tp.get("tokens_per_s"),
        "model_tflops_per_gpu": tp.get("model_tflops_per_gpu"),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "oom": None if oom_ranks is None else bool(oom_ranks),
        "oom_ranks": None if oom_ranks is None else len(oom_ranks),
        "moe_expert_imbalance": moe.get("expert_imbalance"),
        "moe_ep_rank_imbalance": moe.get("ep_rank_imbalance"),
        "moe_a2a_wait_excess_s": effect.get("a2a_wait_excess_s"),
        "moe_dropped_tokens": moe.get("dropped_tokens"),
        "moe_aux_loss": moe.get("aux_loss"),
        "world_size": report.get("world_size"),
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    return line if isinstance(e, Exception) and type(e).__module__.startswith("prism_launch") else \
        f"{type(e).__name__}: {line}"


def run_point(cfg_node: Any, args: LaunchArgs, out: Path, num: int | None, overrides: list[str]) -> dict:
    """Run one sweep point; never raises (except on interruption): errors become the row's status."""
    from omegaconf import OmegaConf

    from prism_launch.config import ConfigError, resolve, validate

    out = Path(out)
    shown = [o.lstrip("+") for o in overrides]
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(point=num, overrides=shown, status="ok")
    t0 = time.monotonic()
    try:
        cfg = OmegaConf.to_object(cfg_node) if not dataclasses.is_dataclass(cfg_node) else copy.deepcopy(cfg_node)
        joined = " ".join(shown)
        if args.nnodes and "target.nnodes" not in joined:
            cfg.target.nnodes = args.nnodes
        if "target.nproc_per_node" not in joined:
            cfg.target.nproc_per_node = args.nproc_per_node
        cfg = resolve(cfg)
        row["world_size"] = cfg.target.world_size
        if cfg.report.dir is None:
            cfg.report.dir = str(out / "report")
        validate(cfg)
        point_args = render_args(cfg, args, out)
        row["script_args"] = shlex.join(point_args.script_args)
        if not point_args.torchrun.log_dir:
            tr = copy.copy(point_args.torchrun)
            tr.log_dir = str(out / "logs")
            point_args = dataclasses.replace(point_args, torchrun=tr)
        from prism_launch import modes
        from prism_launch.trace import ReportLayout

        outcome = modes.run(cfg, point_args)
        report_path = ReportLayout(outcome.report_dir).report_json if outcome.report_dir is not None else None
        if report_path is not None and report_path.exists():
            row.update(summarize_report(json.loads(report_path.read_text())))
            row["report"] = str(report_path)
    except ConfigError as e:
        row["status"] = f"invalid: {e}"
    except Exception as e:  # noqa: BLE001 - a failing point is a row, not a failed sweep
        row["status"] = f"failed: {_first_line(e)}"
    finally:
        # the launcher freezes its heap before forking ranks; unfreeze so the next point's
        # garbage is collectable again
        gc.unfreeze()
        gc.collect()
    row["wall_s"] = round(time.monotonic() - t0, 3)
    try:
        from nccl_ext.core.atomic import atomic_write_text

        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "result.json", json.dumps(row, indent=1, default=str))
    except OSError:
        pass
    return row


class PointTask:
    """Hydra's task function for a sweep (picklable: joblib, submitit and ray ship it)."""

    def __init__(self, args: LaunchArgs, total: int | None = None):
        self.args = args
        self.total = total
        """Points in the sweep (None: the sweeper's own, not known here)."""

    def __call__(self, cfg) -> dict:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        num = hc.job.get("num")
        row = run_point(cfg, self.args, Path(hc.runtime.output_dir), num, list(hc.overrides.task))
        of = f"/{self.total}" if self.total else ""
        # one line per point, in batch logs too: how far the sweep is (points run one after another
        # in the launcher unless a parallel Hydra launcher runs them)
        print(f"prism-launch: sweep point {(num or 0) + 1}{of} {' '.join(row['overrides'])}: {row['status']} "
              f"({row['wall_s']:.1f}s)", file=sys.stderr, flush=True)
        return row


def sweep_size(overrides: list[str]) -> int | None:
    """How many points the basic sweeper makes of ``overrides`` (the product of the sweep
    overrides' choices), or None when a range or another sweeper makes it unknowable here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("hydra.")])
        n = 1
        for o in parsed:
            if o.is_sweep_override():
                n *= len(list(o.sweep_string_iterator()))
        return n
    except Exception:  # noqa: BLE001 - only a progress figure
        return None


# -- the sweep ----------------------------------------------------------------------------------


def _quote(path: Path) -> str:
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_sweep(args: LaunchArgs) -> int:
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    from prism_launch.config import config_dir, normalize_overrides, register

    import logging

    register()
    overrides = normalize_overrides(list(args.overrides))
    GlobalHydra.instance().clear()
    root = logging.getLogger()
    saved_logging = (list(root.handlers), root.level)
    try:
        hydra = Hydra.create_main_hydra2(task_name="prism_sweep",
                                         config_search_path=create_config_search_path(f"file://{config_dir()}"))
        base = hydra.compose_config("config", overrides, run_mode=RunMode.MULTIRUN, with_log_configuration=False,
                                    validate_sweep_overrides=False)
        sweep_dir = Path(str(base.hydra.sweep.dir)).expanduser().resolve()
        rank_by = str(base.get("sweep", {}).get("rank_by", "iteration_time_s"))
        pinned = [o for o in overrides if not o.lstrip("+").startswith("hydra.sweep.dir=")]
        pinned += [f"hydra.sweep.dir={_quote(sweep_dir)}", "hydra.job.chdir=False", "hydra.mode=MULTIRUN"]
        print(f"prism-launch: sweep into {sweep_dir}", file=sys.stderr)
        ret = hydra.multirun(config_name="config", task_function=PointTask(args, sweep_size(overrides)),
                             overrides=pinned)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"prism-launch: error: invalid sweep: {e}", file=sys.stderr)
        return 2
    finally:
        GlobalHydra.instance().clear()
        # Hydra configured logging for its jobs (console + per-job file handlers): give the
        # process its logging back so repeated in-process sweeps do not pile handlers up
        for h in root.handlers:
            if h not in saved_logging[0]:
                h.close()
        root.handlers[:] = saved_logging[0]
        root.setLevel(saved_logging[1])
    rows = collect_rows(ret, sweep_dir)
    if not rows:
        print(f"prism-launch: the sweep produced no points (results: {sweep_dir})", file=sys.stderr)
        return 1
    csv_path, png_path = write_summary(rows, sweep_dir)
    print_table(rows, rank_by=rank_by, csv_path=csv_path, png_path=png_path)
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def collect_rows(ret: Any, sweep_dir: Path) -> list[dict]:
    """Rows from the launcher's job returns; a point whose return was lost is read from its
    ``result.json`` (or recorded as failed)."""
    from hydra.core.utils import JobStatus

    rows = []
    for batch in ret or []:
        for jr in batch if isinstance(batch, (list, tuple)) else [batch]:
            if jr.status == JobStatus.COMPLETED and isinstance(jr.return_value, dict):
                rows.append(jr.return_value)
                continue
            num = None
            try:
                num = jr.hydra_cfg.hydra.job.num
            except Exception:  # noqa: BLE001
                pass
            saved = sweep_dir / str(num) / "result.json" if num is not None else None
            if saved is not None and saved.exists():
                rows.append(json.loads(saved.read_text()))
                continue
            err = jr._return_value if isinstance(getattr(jr, "_return_value", None), BaseException) else None
            row = {c: None for c in COLUMNS}
            row.update(point=num, overrides=list(jr.overrides or []),
                       status=f"failed: {_first_line(err) if err else 'no result returned'}")
            rows.append(row)
    if not rows and sweep_dir.exists():
        rows = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/result.json"))]
    rows.sort(key=lambda r: (r.get("point") is None, r.get("point") or 0))
    return rows


# -- summary --------------------------------------------------------------------------------------


def varying(rows: list[dict]) -> list[str]:
    """Per row: its overrides that are not shared by every row (what the sweep varies)."""
    lists = [list(r.get("overrides") or []) for r in rows]
    common = set.intersection(*(set(x) for x in lists)) if len(lists) > 1 else set()
    return [" ".join(o for o in x if o not in common) or "(base)" for x in lists]


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_summary(rows: list[dict], sweep_dir: Path) -> tuple[Path, Path]:
    """``summary.csv`` and ``summary.png`` in ``sweep_dir``."""
    from nccl_ext.core.atomic import atomic_write_text

    sweep_dir.mkdir(parents=True, exist_ok=True)
    labels = varying(rows)
    for i, r in enumerate(ranked(rows), 1):  # 1: the fastest predicted point; none for a failed one
        r["rank"] = i if r["status"] == "ok" and r.get("iteration_time_s") is not None else None
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    for row, label in zip(rows, labels):
        w.writerow([label if c == "overrides" else _cell(row.get(c)) for c in COLUMNS])
    csv_path = sweep_dir / "summary.csv"
    atomic_write_text(csv_path, buf.getvalue())
    png_path = sweep_dir / "summary.png"
    plot_summary(rows, labels, png_path)
    return csv_path, png_path


def plot_summary(rows: list[dict], labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [(r, lab) for r, lab in zip(rows, labels) if r["status"] == "ok" and r.get("iteration_time_s") is not None]
    bad = [(r, lab) for r, lab in zip(rows, labels) if r["status"] != "ok"]
    moe = [(r, lab) for r, lab in ok if r.get("moe_expert_imbalance") is not None]
    panels = 3 + bool(moe)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 1.6 + 0.45 * max(1, len(rows))), squeeze=False)
    axes = axes[0]
    ys = list(range(len(ok)))
    names = [lab for _, lab in ok]
    axes[0].barh(ys, [r["iteration_time_s"] * 1e3 for r, _ in ok],
                 color=["tab:red" if r.get("oom") else "tab:blue" for r, _ in ok])
    axes[0].set_yticks(ys, names)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("predicted iteration time (ms); red: OOM; * fastest")
    fastest = fastest_point(ok)
    if fastest is not None:
        axes[0].annotate("* fastest", (ok[fastest][0]["iteration_time_s"] * 1e3, fastest), fontsize=8,
                         color="k", va="center", ha="left", fontweight="bold")
    mem = [(r.get("peak_memory_bytes") or 0) / 2**20 for r, _ in ok]
    axes[1].barh(ys, mem, color="tab:green")
    axes[1].set_yticks(ys, [""] * len(ys))
    axes[1].invert_yaxis()
    axes[1].set_xlabel("peak memory, max over ranks (MiB)")
    ax = axes[2]
    mfu = [r.get("mfu") for r, _ in ok]
    if any(v is not None for v in mfu):
        ax.barh(ys, [100 * (v or 0) for v in mfu], color="tab:purple")
        ax.set_xlabel("MFU (% of the cluster GPU's peak BF16)")
    else:  # a cpu cluster has no peak: the throughput per GPU instead
        ax.barh(ys, [r.get("tokens_per_s_per_gpu") or 0 for r, _ in ok], color="tab:purple")
        ax.set_xlabel("tokens/s per GPU (no MFU: the cluster has no GPU peak)")
    ax.set_yticks(ys, [""] * len(ys))
    ax.invert_yaxis()
    for y, (r, _) in enumerate(ok):
        if r.get("tokens_per_s_per_gpu") is not None:
            ax.annotate(f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU", (0, y), fontsize=7, va="center")
    if moe:
        ax = axes[3]
        ax.scatter([r["moe_expert_imbalance"] for r, _ in moe], [r["iteration_time_s"] * 1e3 for r, _ in moe])
        for r, lab in moe:
            ax.annotate(lab, (r["moe_expert_imbalance"], r["iteration_time_s"] * 1e3), fontsize=7)
        ax.set_xlabel("MoE tokens per expert, max / mean")
        ax.set_ylabel("predicted iteration time (ms)")
    if bad:
        text = "\n".join(f"{lab}: {r['status'][:90]}" for r, lab in bad)
        fig.text(0.01, 0.01, text, fontsize=7, color="tab:red", va="bottom")
    fig.suptitle(f"prism-launch sweep: {len(ok)} of {len(rows)} points predicted")
    fig.tight_layout(rect=(0, 0.04 * min(len(bad), 5), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fastest_point(ok: list[tuple[dict, str]]) -> int | None:
    """Index in ``ok`` (rows with a prediction) of the shortest predicted iteration."""
    times = [r.get("iteration_time_s") for r, _ in ok]
    known = [i for i, t in enumerate(times) if t is not None]
    return min(known, key=lambda i: times[i]) if known else None


def ranked(rows: list[dict], rank_by: str = "iteration_time_s") -> list[dict]:
    """ok rows by ``rank_by`` ascending (missing values last), then invalid and failed rows."""
    def key(r):
        v = r.get(rank_by)
        return (r["status"] != "ok", v is None, v if isinstance(v, (int, float)) else 0, r.get("point") or 0)

    return sorted(rows, key=key)


def print_table(rows: list[dict], *, rank_by: str = "iteration_time_s", csv_path: Path | None = None,
                png_path: Path | None = None, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stderr, highlight=False, width=160)
    labels = dict(zip((id(r) for r in rows), varying(rows)))
    table = Table(title=f"prism-launch sweep: {len(rows)} points, ranked by {rank_by}", title_justify="left")
    for name, just in (("#", "right"), ("point", "right"), ("overrides", "left"), ("iter time (ms)", "right"),
                       ("MFU", "right"), ("tok/s/GPU", "right"), ("peak mem (MiB)", "right"), ("OOM", "left"), ("MoE max/mean expert", "right"),
                       ("MoE max/mean EP rank", "right"), ("MoE dropped", "right"), ("MoE aux loss", "right"),
                       ("status", "left")):
        table.add_column(name, justify=just, overflow="fold")
    for i, r in enumerate(ranked(rows, rank_by), 1):
        it, mem = r.get("iteration_time_s"), r.get("peak_memory_bytes")
        ei, ri = r.get("moe_expert_imbalance"), r.get("moe_ep_rank_imbalance")
        status = r["status"]
        style = "" if status == "ok" else ("yellow" if status.startswith("invalid") else "red")
        table.add_row(str(i), _cell(r.get("point")), labels[id(r)],
                      "" if it is None else f"{it * 1e3:.2f}",
                      "" if r.get("mfu") is None else f"{r['mfu']:.1%}",
                      "" if r.get("tokens_per_s_per_gpu") is None else f"{r['tokens_per_s_per_gpu']:,.1f}",
                      "" if mem is None else f"{mem / 2**20:.1f}",
                      "" if r.get("oom") is None else ("yes" if r["oom"] else "no"),
                      "" if ei is None else f"{ei:.2f}", "" if ri is None else f"{ri:.2f}",
                      _cell(r.get("moe_dropped_tokens")),
                      "" if r.get("moe_aux_loss") is None else f"{r['moe_aux_loss']:.4g}", status, style=style)
    console.print(table)
    if csv_path is not None:
        console.print(f"summary: {csv_path}" + (f"  plot: {png_path}" if png_path else ""))
