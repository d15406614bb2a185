"""The emulation report: what the sandbox ranks did, how long their steps took, and
whether their losses match the capture's, as ``report.json`` plus a terminal table."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from nccl_ext.core.atomic import atomic_write_text
from prism_launch.launch.logs import parse_rank_log
from prism_launch.report import plots
from prism_launch.trace import RankLogs, ReportLayout, TraceLayout

if TYPE_CHECKING:
    from prism_launch.config import PrismConfig
    from prism_launch.trace import TraceReader


def _step_times(steps: list[dict]) -> list[float]:
    """Seconds per scheduling unit (the first one counts from the rank's first op)."""
    return [s["duration_s"] for s in steps]


def build_report(cfg: PrismConfig, reader: TraceReader, trace: TraceLayout, out: ReportLayout, sandbox: list[int],
                 log_dir: Path, wall_s: float, sandbox_oom: dict | None = None) -> dict:
    """Write ``report.json`` (and the prediction's timeline and plots) into ``out`` from the
    sandbox ranks' summaries and logs; print the terminal table; return the report."""
    captured = reader.read_json(TraceLayout.STEPS) if TraceLayout.STEPS in reader.json_files() else {}
    ranks = {}
    for r in sandbox:
        summary_path = out.summary(r)
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        steps = parse_rank_log(RankLogs(log_dir).stdout(r), cfg.report)
        recorded = captured.get(str(r), [])
        match = None
        if steps and recorded:
            match = [s["loss"] for s in steps] == [s["loss"] for s in recorded]
        ranks[str(r)] = {
            "sandbox": True,
            "steps": [s["step"] for s in steps],
            "losses": [s["loss"] for s in steps],
            "captured_losses": [s["loss"] for s in recorded],
            "losses_match_capture": match,
            "step_times_s": _step_times(summary.get("steps", [])),
            "ops": summary.get("ops"),
            "p2p": summary.get("p2p"),
            "physical_exchanges": summary.get("physical_exchanges"),
            "replay_wait_s": summary.get("waited_s"),
            "divergences": summary.get("divergences", []),
            "divergence_counts": summary.get("divergence_counts", {}),
            "synthesized": summary.get("synthesized", 0),
            "carried": summary.get("carried", 0),
            "peak_memory_bytes": (summary.get("memory") or {}).get("peak_bytes"),
            # the caching allocator's peak hold on the device (CUDA only): torch.cuda's
            # reserved_bytes.all.peak, the figure torchtitan logs as its memory
            "peak_reserved_bytes": (summary.get("memory") or {}).get("peak_reserved_bytes"),
            "memory_method": ((summary.get("memory") or {}).get("method") or {}).get("name"),
            "memory_details": (summary.get("memory") or {}).get("details"),
        }
    report = {
        "world_size": reader.manifest.world_size,
        "topology": reader.manifest.topology,
        "sandbox_ranks": sandbox,
        "virtual_ranks": reader.manifest.world_size - len(sandbox),
        "groups_in_trace": len(reader.manifest.groups),
        "trace_dir": str(trace.root),
        "log_dir": str(log_dir),
        "emulation_wall_s": wall_s,
        "virtual_host": str(cfg.emulate.virtual_host),
        "assistant": json.loads(out.assistant_summary().read_text()) if out.assistant_summary().exists() else None,
        "ranks": ranks,
        "payload": _payload(reader),
    }
    if TraceLayout.FOLD in reader.json_files():
        fold = reader.read_json(TraceLayout.FOLD)
        report["fold"] = {
            "captured_ranks": len(fold["captured"]),
            "world_size": fold["world_size"],
            "exact": "sandbox ranks inside the captured set: everything they compute from their own data and "
                     "their model-parallel peers, bit-identical to the folded capture",
            "approximated": "contributions of uncaptured data-parallel replicas (copies of their captured "
                            "stand-ins' data; exact only when replicas see the same data), MoE routing of "
                            "uncaptured replicas (that of the stand-in), and uncaptured ranks' timelines "
                            "(their stand-ins')",
            "approximated_model_parallel_groups": fold.get("approximated_groups", []),
        }
        if fold.get("tp_positions"):  # capture.tp_sample (payload none): prism_launch.capture.fold
            report["fold"]["tensor_parallel"] = {
                "captured_tp_positions": fold["tp_positions"],
                "mirrored": "ranks at other TP positions: each does what its TP group's captured member nearest to it "
                            "(other than position 0) does, op for op, with that member's timeline and memory; their "
                            "contributions to TP collectives are that member's (payload none: every result synthesized)"}
        if fold.get("ep_positions"):  # capture.ep_sample: prism_launch.capture.ep_fold
            report["fold"]["expert_parallel"] = {
                "captured_ep_positions": fold["ep_positions"], "ops": fold.get("ep_fold"),
                "exact": "all-to-all pieces and token counts between captured EP ranks",
                "synthesized": "uncaptured EP ranks' token counts (the captured routers' tokens per expert at each "
                               "dispatch, over their own token count) and their all-to-all pieces (those sizes, a "
                               "captured rank's rows)"}
    out.root.mkdir(parents=True, exist_ok=True)
    from prism_launch.predict.prediction import predict

    captured_memory = reader.read_json(TraceLayout.MEMORY) if TraceLayout.MEMORY in reader.json_files() else {}
    memory = {int(r): m["peak_bytes"] for r, m in captured_memory.items() if m.get("peak_bytes") is not None}
    memory.update({int(r): v["peak_memory_bytes"] for r, v in ranks.items() if v.get("peak_memory_bytes") is not None})
    pred = predict(cfg, reader, trace, sandbox, memory)
    plots.write(out, pred, cfg.cluster.gpus_per_node)
    report["predicted"] = pred["predicted"]
    try:
        from prism_launch.report.moe_stats import moe_stats

        moe = moe_stats(cfg, reader, trace, plot_dir=out.root)
    except Exception as e:  # noqa: BLE001 - the MoE section never breaks a report
        moe = {"error": f"{type(e).__name__}: {e}"}
    if moe:
        report["moe"] = moe
    report["pipeline_ranks"] = pred["pipeline_ranks"]
    for r, entry in pred["ranks"].items():
        merged = {**entry, **ranks.get(r, {})}
        source = captured_memory.get(r) or {}
        if not merged.get("memory_details") and source.get("details"):
            merged["memory_details"] = source["details"]  # a captured rank's own, as it reported them
        if entry.get("peak_memory_bytes") is not None:
            merged["peak_memory_bytes"] = entry["peak_memory_bytes"]
        if merged.get("peak_reserved_bytes") is None and source.get("peak_reserved_bytes") is not None:
            merged["peak_reserved_bytes"] = source["peak_reserved_bytes"]  # as measured in its capture
        report["ranks"][r] = merged
    if sandbox_oom is not None:
        report["sandbox_oom"] = sandbox_oom
        r = str(sandbox_oom.get("rank"))
        if r in report["ranks"]:  # it stopped at the limit: its measured peak is a lower bound
            report["ranks"][r]["oom"] = True
        oom_ranks = report["predicted"]["oom_ranks"]
        if sandbox_oom.get("rank") is not None and sandbox_oom["rank"] not in oom_ranks:
            oom_ranks.append(sandbox_oom["rank"])
            oom_ranks.sort()
    atomic_write_text(out.report_json, json.dumps(report, indent=1))
    print_report(report, out.report_json)
    return report


def _detail_line(detail: dict) -> str:
    """An integration's memory breakdown in one line: its byte figures in MiB."""
    def fmt(key, v):
        if isinstance(v, dict):
            return f"{key} {{" + ", ".join(fmt(k, x) for k, x in v.items()) + "}"
        if key.endswith("bytes") and isinstance(v, (int, float)):
            return f"{key[:-6] or 'bytes'} {v / 2**20:.2f} MiB"
        return f"{key} {v}"

    return "; ".join(fmt(k, v) for k, v in detail.items())


def _payload(reader: TraceReader) -> dict:
    """The trace's payload policy and what it means for the values the sandbox saw."""
    extra = reader.manifest.extra or {}
    policy = extra.get("payload", "exact")
    out = {"policy": policy}
    if extra.get("payload_ranks") is not None:
        out["sandbox_ranks"] = extra["payload_ranks"]  # exact: the trace stores what these ranks consume
    if policy == "none":
        out["synthesized"] = (
            "every collective's and receive's result, in capture and emulation alike: computed on the "
            "rank's device as if each other member contributed what this rank contributes (sums scaled by "
            "the group size; gathers repeat this rank's piece; received buffers filled with uniform values "
            "in [0.5, 1.5), integers 0), except broadcasts up to "
            f"{extra.get('carry_bytes', 0)} bytes, which carry their recorded payload. Op sequence, shapes "
            "of dense layers, timings and memory are the job's; values, MoE routing (hence all-to-all "
            "sizes) and losses are the synthesized run's, not the target's")
    return out


def _compute_label(pred: dict) -> str:
    cal = pred.get("calibration")
    if not cal:
        return pred["compute_source"]
    return f"{pred['compute_source']}: {cal.get('slices')} slices, {cal.get('method') or 'shared devices'}"


def compute_caveat(pred: dict) -> str:
    """What the table says when the compute spans were measured on another kind of device than
    the target cluster's, or on another GPU that could not be scaled to the cluster's (only
    communication is then the cluster's)."""
    measured, target = pred.get("compute_device"), pred.get("cluster_device")
    scaling = pred.get("gpu_scaling") or {}
    if (measured == target == "cuda" and not pred.get("compute_scaled") and scaling.get("why")
            and scaling.get("measuring_device") != pred.get("cluster_gpu")):
        return (f"; compute is {scaling.get('measuring_device') or 'the measuring GPU'}'s as measured, not scaled to "
                f"{pred.get('cluster_gpu')}: {scaling['why']}")
    if not measured or not target or measured == target or pred.get("compute_scaled"):
        return ""
    kind = {"cuda": "GPU", "cpu": "CPU"}
    return (f"; compute is this machine's {kind.get(measured, measured)} as measured, not scaled to "
            f"{pred['cluster']}'s {kind.get(target, target)}s: only communication is {pred['cluster']}'s")


def prediction_lines(pred: dict) -> list[str]:
    """The terminal's prediction summary, each figure with the span it covers: the iteration time
    is one steady-state step, the critical path the whole replayed run (every step)."""
    steps = len(pred.get("iteration_times_s") or [])
    which = ("median of the steps after the first" if steps > 2 else f"median of {steps} step(s)") if steps else "a step"
    path = pred["critical_path"]
    ranks = path["ranks"]
    shown = f"{ranks[:8]}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return [
        f"[bold]predicted on {pred['cluster']}[/bold] ({_compute_label(pred)} compute spans){compute_caveat(pred)}",
        f"  iteration time {pred['iteration_time_s'] * 1e3:.2f} ms: one step of the whole job, as the slowest "
        f"rank ends it ({which})",
        f"  critical path over the whole replayed run ({steps} steps, the first included): "
        f"{path['compute_s'] * 1e3:.1f} ms compute + {path['comm_s'] * 1e3:.1f} ms communication, "
        f"through ranks {shown}",
        *host_lines(pred),
        *compute_statement_lines(pred),
        *throughput_lines(pred),
    ]


def host_lines(pred: dict) -> list[str]:
    """A host-bound prediction's second figure: the step on a host that keeps up."""
    h = pred.get("host_kept_up")
    if not h:
        return []
    return [f"  host-bound: the GPU was busy {h['busy_share']:.0%} of the calibrated compute, so this figure follows "
            f"the measuring host's speed; with a host that keeps up (CUDA graphs, a faster CPU; "
            f"replay.host_gaps=removed): {h['iteration_time_s'] * 1e3:.2f} ms"]


def step_line(rank: int, step: dict) -> str:
    """One predicted steady step of ``rank`` (:func:`~prism_launch.predict.prediction.step_breakdown`):
    compute, waits on collectives by group (exposed communication and waiting for the group's
    last member), waits on point-to-point receives (pipeline bubble and exposed transfers)."""
    waits = sorted(((s, name) for name, s in step["collective_waits_s"].items() if s >= 5e-5), reverse=True)
    by_group = ", ".join(f"{name} {s * 1e3:.1f}" for s, name in waits) or "none"
    return (f"  rank {rank}, one steady step: compute {step['compute_s'] * 1e3:.1f} ms; collective waits by group "
            f"(ms): {by_group}; point-to-point waits (bubble, transfers) {step['p2p_waits_s'] * 1e3:.1f} ms")


def compute_statement_lines(pred: dict) -> list[str]:
    """Where the compute spans came from and what that means for accuracy
    (:mod:`prism_launch.predict.compute_source`); a source the trace's device does not call
    for is a warning."""
    text = pred.get("compute_statement")
    if not text:
        return []
    if pred.get("compute_warning"):
        return [f"  [bold red]warning: compute spans: {text}[/bold red]"]
    return [f"  compute spans: {text}"]


def _num(v: float | None, fmt: str, unknown: str = "unknown") -> str:
    return unknown if v is None else format(v, fmt)


def throughput_lines(pred: dict) -> list[str]:
    """Throughput and MFU of the predicted iteration, the compute scaling behind it, and the
    MFU warning where the figure is implausible (an older report without them: none)."""
    t = pred.get("throughput")
    if t is None:
        return []
    toks = (f"{_num(t['tokens_per_s'], ',.0f')} tokens/s, {_num(t['tokens_per_s_per_gpu'], ',.1f')} tokens/s/GPU (TPS/GPU)"
            if t.get("tokens_per_step") else f"tokens unknown ({t.get('tokens_source')})")
    peak = t.get("peak_bf16_tflops")
    from prism_launch.predict.throughput import percent

    mfu = (f"MFU {percent(t['mfu'])} of {pred.get('cluster_gpu')}'s {peak:g} TFLOP/s BF16" if t.get("mfu") is not None
           else "MFU unknown (" + ("no counted FLOPs" if not t.get("model_flops_per_step")
                                   else f"cluster.gpu {pred.get('cluster_gpu')} has no peak") + ")")
    lines = [f"  throughput {toks}; model {_num(t.get('model_tflops_per_gpu'), '.4g')} TFLOP/s per GPU; {mfu}",
             f"    model FLOPs per step {_num(t.get('model_flops_per_step'), '.4g')} ({t.get('flops_source')}); "
             f"tokens per step {_num(t.get('tokens_per_step'), ',')} ({t.get('tokens_source')})"]
    s = pred.get("gpu_scaling") or {}
    if s.get("scaled"):
        lines.append(f"  compute scaled {s['measuring_device']} -> {s['target_gpu']}: FLOP-bound x{s['compute_factor']:.3f}, "
                     f"memory-bound x{s['memory_factor']:.3f}, mean x{s['mean_factor']:.3f} over "
                     f"{s['compute_fraction']:.0%} FLOP-bound / {s['memory_fraction']:.0%} memory-bound / "
                     f"{s['comm_fraction']:.0%} communication / {s.get('other_fraction', 0.0):.0%} kept as measured "
                     f"(GPU idle, waiting on its host, or kernels of no known class) (kernel mix: {s['mix_source']})")
    elif s.get("why"):
        lines.append(f"  compute not scaled: {s['why']}")
    if "host_gaps_removed" in s:
        h = s["host_gaps_removed"]
        k = h.get("kernel_share")
        kept = ("no shard class was profiled: every span stays as measured (calibrate.kernel_mix)" if not k else
                f"each span keeps its class's kernel share ({k[0]:.0%}" + (f"-{k[1]:.0%}" if k[1] != k[0] else "") + ")")
        lines.append("  compute spans without the GPU's waits on its host (replay.host_gaps=removed, a what-if of a "
                     f"host that keeps up, e.g. CUDA graphs): {kept}"
                     + (f"; {len(h['ranks_unchanged'])} rank(s) not profiled kept as measured" if h.get("ranks_unchanged")
                        and k else ""))
    if s.get("compute_speedup"):
        lines.append(f"  compute spans divided by replay.compute_speedup={s['compute_speedup']:g} (a what-if, "
                     "not measured in this run)")
    if pred.get("mfu_warning"):
        lines.append(f"  [bold red]warning[/bold red]: {pred['mfu_warning']}")
    return lines


def _divergence_kinds(r: dict) -> str:
    c = r.get("divergence_counts") or {}
    if not c:
        return str(len(r["divergences"]))
    return (f"{c.get('value', 0)} (+{c.get('tolerance', 0)} within tolerance, "
            f"{c.get('host_scalar', 0)} host scalars)")


def print_report(report: dict, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stderr, highlight=False)
    topo = report["topology"]
    console.print(
        f"[bold]PrismLLM emulation[/bold]: logical world {report['world_size']} "
        f"({topo.get('nnodes')} nodes x {topo.get('nproc_per_node')}), sandbox ranks {report['sandbox_ranks']}, "
        f"{report['virtual_ranks']} virtual ranks replayed, wall {report['emulation_wall_s']:.1f}s"
    )
    for rank, r in report["ranks"].items():
        if "losses" not in r:
            continue  # virtual rank: predicted figures only
        table = Table(title=f"sandbox rank {rank}", title_justify="left")
        table.add_column("step", justify="right")
        table.add_column("loss", justify="right")
        table.add_column("captured loss", justify="right")
        table.add_column("step time (s)", justify="right")
        n = max(len(r["losses"]), len(r["step_times_s"]))
        steps = r.get("steps") or list(range(1, n + 1))
        for i in range(n):
            loss = r["losses"][i] if i < len(r["losses"]) else None
            cap = r["captured_losses"][i] if i < len(r["captured_losses"]) else None
            st = r["step_times_s"][i] if i < len(r["step_times_s"]) else None
            table.add_row(str(steps[i]) if i < len(steps) else str(i + 1), "" if loss is None else repr(loss), "" if cap is None else repr(cap),
                          "" if st is None else f"{st:.3f}")
        console.print(table)
        verdict = {True: "[green]bit-identical to the capture[/green]", False: "[red]DIFFER from the capture[/red]",
                   None: "no loss lines to compare"}[r["losses_match_capture"]]
        if r.get("peak_memory_bytes") is not None:
            reserved = ("" if r.get("peak_reserved_bytes") is None
                        else f"; peak reserved {r['peak_reserved_bytes'] / 2**30:.2f} GiB (the caching allocator's hold)")
            console.print(f"  peak memory {r['peak_memory_bytes'] / 2**20:.1f} MiB ({r.get('memory_method')}){reserved}")
        for name, detail in (r.get("memory_details") or {}).items():
            console.print(f"  {name} memory: {_detail_line(detail)}")
        if r.get("synthesized"):
            console.print(f"  payload none: {r['synthesized']} results synthesized on the sandbox's device "
                          f"({r.get('carried', 0)} broadcasts carried their recorded payload); values are not the "
                          "target's (report.json: payload)")
        console.print(f"  losses: {verdict}; ops replayed {r['ops']} (+{r['p2p']} p2p), "
                      f"divergences {_divergence_kinds(r)}, replayed waits {r['replay_wait_s'] or 0:.3f}s")
    pred = report.get("predicted")
    if pred:
        for line in prediction_lines(pred):
            console.print(line, soft_wrap=True)  # one figure, one line, whatever the width
        for rank, r in report["ranks"].items():
            if r.get("sandbox") and r.get("step"):
                console.print(step_line(int(rank), r["step"]), soft_wrap=True)
        if pred["stragglers"]:
            s0 = pred["stragglers"][0]
            console.print(f"  top straggler: rank {s0['rank']} (made peers wait {s0['delay_caused_s'] * 1e3:.2f} ms)")
        console.print(f"  OOM at {pred['memory_limit_bytes'] / 2**30:.0f} GiB: "
                      f"{pred['oom_ranks'] or 'none'}")
    if report.get("moe"):
        if "error" in report["moe"]:
            console.print(f"  MoE statistics unavailable: {report['moe']['error']}")
        else:
            from prism_launch.report.moe_stats import print_moe

            print_moe(report["moe"], console)
    if report.get("assistant"):
        streams = report["assistant"]["streams"].values()
        console.print(f"  assistant streamed {sum(s['messages'] for s in streams)} messages, "
                      f"{sum(s['bytes'] for s in streams) / 2**20:.1f} MiB of recorded virtual-rank data")
    console.print(f"report: {path} (beside it: timeline.json for ui.perfetto.dev, PNG plots)", soft_wrap=True)
