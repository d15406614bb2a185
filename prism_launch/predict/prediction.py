"""Predictions at target scale from the (calibrated) graph: the global replay with the
target cluster's network model, per-rank iteration times and memory, the OOM verdict (the
timeline and plots of a prediction are the report's: :mod:`prism_launch.report.plots`)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from prism_launch.config import HostGaps
from prism_launch.predict.gpu_scaling import KernelMix
from prism_launch.trace import TraceLayout

if TYPE_CHECKING:
    from prism_launch.config import PrismConfig
    from prism_launch.trace import TraceReader


def _pipeline_of(rows: list[dict], rank: int) -> list[int]:
    """Ranks connected to ``rank`` by point-to-point messages (its pipeline), in order."""
    peers: dict[int, set[int]] = {}
    for row in rows:
        if row["kind"] == "p2p":
            peers.setdefault(row["rank"], set()).add(row["peer"])
            peers.setdefault(row["peer"], set()).add(row["rank"])
    seen, todo = {rank}, deque([rank])
    while todo:
        for q in peers.get(todo.popleft(), ()):
            if q not in seen:
                seen.add(q)
                todo.append(q)
    return sorted(seen)


def _timeline_ranks(cfg: PrismConfig, world: int, sandbox: list[int], pipeline: list[int]) -> list[int]:
    if cfg.replay.timeline_ranks is not None:
        return sorted(set(cfg.replay.timeline_ranks))
    cap = cfg.replay.timeline_max_ranks
    chosen = list(dict.fromkeys([*sandbox, *pipeline]))[:cap]
    step = max(1, world // max(1, cap - len(chosen)))
    chosen += [r for r in range(0, world, step) if r not in chosen][: max(0, cap - len(chosen))]
    return sorted(chosen)


def graph_source(cfg: PrismConfig, bare: TraceReader, trace: TraceLayout):
    """The trace whose compute spans the replay uses, its origin (source, clock, what it means
    for accuracy) and the clock; a trace captured on CUDA without calibration is refused, never
    replayed from host CPU time silently (:mod:`prism_launch.predict.compute_source`)."""
    from prism_launch.predict.compute_source import select

    reader, origin = select(cfg, bare, trace)
    return reader, origin, origin.clock


def calibration_method(calibrated: TraceReader) -> dict:
    """How a calibrated trace's spans were measured (its manifest's record of the slices)."""
    extra = calibrated.manifest.extra
    keys = ("method", "ranks_per_slice", "devices", "device", "measure", "slice_size", "by_class", "repeats")
    out = {k: extra.get(k) for k in keys}
    out["slices"] = len(extra.get("slices") or [])
    out["shard_classes"] = len(extra.get("shard_classes") or [])
    return out


def scaled_rows(cfg: PrismConfig, bare: TraceReader, reader: TraceReader, compute: str) -> tuple[list[dict], dict, object]:
    """The graph's event rows, their compute spans scaled from the measuring device to the
    cluster's GPU (:mod:`prism_launch.predict.gpu_scaling`), with how, and the counted FLOPs."""
    from prism_launch.predict.throughput import counted, scale_rows

    rows = reader.events().to_pylist()
    count = counted(bare)
    device = reader.manifest.extra.get("measuring_device") or bare.manifest.extra.get("measuring_device")
    removed = cfg.replay.host_gaps == HostGaps.removed
    host = remove_host_gaps(rows, reader) if removed else None
    scaling = scale_rows(rows, device, cfg.cluster.gpu, count, compute, kernel_mixes(reader, whole_span=not removed))
    if host is not None:
        scaling = {**scaling, "host_gaps_removed": host}
    if cfg.replay.compute_speedup != 1.0:
        scaling = {**scaling, "compute_speedup": speed_up(rows, cfg.replay.compute_speedup)}
    return rows, scaling, count


def kernel_share(mix: dict) -> float | None:
    """The share of a shard class's calibrated compute the GPU spent in kernels of any class
    (communication included), from its ``busy_share`` (non-communication kernel time over the
    span); None where the class was not profiled."""
    busy = mix.get("busy_share")
    if busy is None:
        return None
    return 1.0 if mix["comm"] >= 1.0 else min(1.0, max(0.0, float(busy)) / (1.0 - mix["comm"]))


def remove_host_gaps(rows: list[dict], reader: TraceReader) -> dict:
    """Keep only the kernels' share of every compute span of ``rows`` (in place), per shard class
    (``replay.host_gaps=removed``: the what-if of a host that keeps up); what the report shows of
    it: the classes' kernel shares and the ranks whose spans stayed as measured (not profiled)."""
    share: dict[int, float] = {}
    for m in reader.manifest.extra.get("kernel_mixes") or []:
        if (k := kernel_share(m)) is not None:
            share.update((int(r), k) for r in m["members"])
    unchanged = set()
    for row in rows:
        k = share.get(row["rank"])
        if k is None:
            unchanged.add(row["rank"])
            continue
        row["compute_cpu_s"] = (row["compute_cpu_s"] or 0.0) * k
        row["compute_wall_s"] = (row["compute_wall_s"] or 0.0) * k
    used = sorted({share[r["rank"]] for r in rows if r["rank"] in share})
    return {"kernel_share": (used[0], used[-1]) if used else None, "ranks_unchanged": sorted(unchanged)}


def kernel_mixes(reader: TraceReader, whole_span: bool = True) -> dict[int, KernelMix]:
    """Each calibrated rank's kernel mix, its shard class's (``calibrate.kernel_mix``: the calibrated
    manifest's ``kernel_mixes``); empty for a trace calibrated without, or not calibrated. Where the
    class's ``busy_share`` is known and ``whole_span``, the fractions are of the whole span: the
    kernels' shares times the share the GPU was busy, the rest (the GPU waiting on its host) kept as
    measured; without ``whole_span`` (spans already cut to their kernels: :func:`remove_host_gaps`)
    they are of the kernels' time."""
    out: dict[int, KernelMix] = {}
    for m in reader.manifest.extra.get("kernel_mixes") or []:
        busy = m.get("busy_share")  # non-communication kernel time over the span
        k = kernel_share(m) if whole_span and busy is not None else 1.0
        source = f"profiler ({m.get('activity') or 'kernels'} of one step of each shard class)"
        if busy is not None:
            source += f", GPU busy {busy:.0%} of its calibrated compute"
        mix = KernelMix(compute=m["compute"] * k, memory=m["memory"] * k, comm=m["comm"] * k, source=source, busy=busy)
        out.update((int(r), mix) for r in m["members"])
    return out


def speed_up(rows: list[dict], speedup: float) -> float:
    """Divide every compute span of ``rows`` (in place) by ``speedup`` (``replay.compute_speedup``)."""
    for row in rows:
        row["compute_cpu_s"] = (row["compute_cpu_s"] or 0.0) / speedup
        row["compute_wall_s"] = (row["compute_wall_s"] or 0.0) / speedup
    return speedup


def replay_rows(cfg: PrismConfig, reader: TraceReader, rows: list[dict], compute: str, **kw):
    """The global replay of ``rows`` (``reader``'s event rows, scaled) on the cluster's network
    model (:func:`~prism_launch.predict.simulate.replay`, ``kw`` passed on)."""
    from prism_launch.predict.cost_model import make_cost_model
    from prism_launch.predict.simulate import graph_from_events, replay

    groups = {int(g["id"]): tuple(g["ranks"]) for g in reader.manifest.groups}
    graph = graph_from_events(rows, groups, reader.manifest.world_size, compute=compute)
    return replay(graph, make_cost_model(cfg.replay.cost_model, cfg.cluster), comm_on_cores=cfg.cluster.comm_on_cores,
                  **kw)


def schedule(cfg: PrismConfig, bare: TraceReader, trace: TraceLayout) -> dict[int, list[float]]:
    """Each captured rank's predicted issue time of every event (trace order) on the target
    cluster: the arrival times emulation gives virtual peers (``emulate.timing=predicted``)."""
    reader, _source, compute = graph_source(cfg, bare, trace)
    rows, _scaling, _count = scaled_rows(cfg, bare, reader, compute)
    return replay_rows(cfg, reader, rows, compute, record_issue=True).issue_times


def predict(cfg: PrismConfig, bare: TraceReader, trace: TraceLayout, sandbox: list[int],
            memory: dict[int, int]) -> dict:
    reader, origin, compute = graph_source(cfg, bare, trace)
    source = origin.source
    rows, scaling, count = scaled_rows(cfg, bare, reader, compute)
    names = group_names(reader.manifest.groups)
    world = reader.manifest.world_size
    pipeline = _pipeline_of(rows, sandbox[0])
    tl_ranks = _timeline_ranks(cfg, world, sandbox, pipeline)
    # issue times: the pipeline picture's
    rep = replay_rows(cfg, reader, rows, compute, timeline_ranks=tl_ranks, record_issue=True)

    limit = int(cfg.cluster.gpu_memory_gib * 2**30)
    ranks = {}
    for r in sorted(rep.ranks):
        res = rep.ranks[r]
        peak = memory.get(r)
        ranks[str(r)] = {
            "sandbox": r in sandbox,
            "iteration_time_s": rep.rank_iteration_time(r),
            "compute_s": res.compute_s, "exposed_comm_s": res.blocked_s - res.bubble_s,
            "bubble_s": res.bubble_s, "peak_memory_bytes": peak,
            "oom": None if peak is None else peak > limit,
            "step": step_breakdown(res.steady_step(), names),
        }
    fold = bare.read_json(TraceLayout.FOLD) if TraceLayout.FOLD in bare.json_files() else None
    if fold is not None:  # expand to the whole world: an uncaptured rank mirrors its stand-in
        for u, src in enumerate(fold["rep"]):
            if str(u) not in ranks and str(src) in ranks:
                ranks[str(u)] = {**ranks[str(src)], "sandbox": False, "mirrors": src}
    predicted = {
        "iteration_time_s": rep.iteration_time_s,
        "iteration_times_s": rep.iteration_times,
        "oom_ranks": [int(r) for r, v in ranks.items() if v["oom"]],
        "memory_limit_bytes": limit,
        "compute_source": source,
        "compute_statement": origin.statement,
        "compute_warning": origin.loud,
        "calibration": calibration_method(reader) if source == "calibrated" else None,
        "cluster": cfg.cluster.name,
        "compute_device": str(cfg.device),
        "compute_scaled": bool(scaling.get("scaled")),
        "gpu_scaling": scaling,
        "cluster_gpu": cfg.cluster.gpu.name,
        "cluster_device": cfg.cluster.device,
        "critical_path": _summarize_path(rep.critical_path),
        "stragglers": rep.stragglers,
        "ranks_replayed": len(rep.ranks),
    }
    predicted["throughput"] = _throughput(cfg, bare, count, rep.iteration_time_s, world, fold)
    predicted["host_kept_up"] = host_kept_up(cfg, bare, reader, compute, scaling, rep.iteration_time_s)
    from prism_launch.predict.throughput import mfu_warning

    predicted["mfu_warning"] = mfu_warning(predicted) or None
    return {"predicted": predicted, "ranks": ranks, "pipeline_ranks": pipeline, "replay": rep,
            "rows": rows, "compute_clock": compute}


def host_kept_up(cfg: PrismConfig, bare: TraceReader, reader: TraceReader, compute: str, scaling: dict,
                 iteration_s: float) -> dict | None:
    """For a host-bound prediction (the GPU busy less than ``HOST_BOUND_BUSY`` of its calibrated
    compute), the same replay with ``replay.host_gaps=removed``: the step on a host that keeps up
    (CUDA graphs, a faster CPU), which the measuring host's speed does not enter. None otherwise."""
    import dataclasses

    from prism_launch.predict.throughput import HOST_BOUND_BUSY

    busy = scaling.get("busy_share")
    if busy is None or busy >= HOST_BOUND_BUSY or cfg.replay.host_gaps != HostGaps.measured or not iteration_s:
        return None
    what_if = dataclasses.replace(cfg, replay=dataclasses.replace(cfg.replay, host_gaps=HostGaps.removed))
    rows, _scaling, _count = scaled_rows(what_if, bare, reader, compute)
    t = replay_rows(cfg, reader, rows, compute)
    return {"iteration_time_s": t.iteration_time_s, "busy_share": busy,
            "speedup": iteration_s / t.iteration_time_s if t.iteration_time_s else None}


def group_names(groups: list[dict]) -> dict[int, str]:
    """Each process group's name in a breakdown: the description its creator gave it (Megatron's
    ``TENSOR_MODEL_PARALLEL_GROUP``, a DeviceMesh dimension's name), else its size."""
    return {int(g["id"]): g.get("desc") or f"group of {len(g['ranks'])}" for g in groups}


def step_breakdown(step: dict, names: dict[int, str]) -> dict:
    """One steady step of a rank (:meth:`RankResult.steady_step`): compute, waits on collectives
    by group name (exposed communication and waiting for the group's last member), and waits on
    point-to-point receives (pipeline bubbles with the exposed transfers)."""
    by_name: dict[str, float] = {}
    for gid, s in step["blocked_by_group"].items():
        name = names.get(gid, f"group {gid}")
        by_name[name] = by_name.get(name, 0.0) + s
    return {"compute_s": step["compute_s"], "collective_waits_s": by_name,
            "p2p_waits_s": step["bubble_s"], "waits_s": step["blocked_s"]}


def _throughput(cfg: PrismConfig, bare: TraceReader, count, iteration_s: float, world: int, fold: dict | None) -> dict:
    from prism_launch.predict.throughput import integration_flops, step_flops, throughput, tokens

    n_tokens, how = tokens(cfg, bare, count)
    flops = step_flops(count, world, fold)
    if count.per_rank:
        flops_how = f"FlopCounterMode over step {count.step} of {len(count.per_rank)} captured rank(s)"
    elif count.not_counted:  # the ranks could not count (torch.compile): the integration's own count, if any
        flops, own = integration_flops(cfg, bare)
        flops_how = f"{own}; the capture did not count: {count.not_counted}" if flops else \
            f"not counted: {count.not_counted} ({own})"
    else:
        flops_how = "not counted (trace captured before ranks counted FLOPs)"
    out = throughput(iteration_s, flops, n_tokens, world, cfg.cluster.gpu)
    out.update(tokens_source=how, flops_source=flops_how)
    if count.incomplete:
        out["flops_incomplete_ranks"] = count.incomplete
    return out


def _summarize_path(path: list[dict]) -> dict:
    compute = sum(s["s"] for s in path if s["kind"] == "compute")
    comm = sum(s["s"] for s in path if s["kind"] == "comm")
    hops = [s for s in path if s["kind"] == "comm"]
    return {"compute_s": compute, "comm_s": comm, "segments": len(path),
            "ranks": sorted({s["rank"] for s in path}), "longest_comm": sorted(hops, key=lambda s: -s["s"])[:5]}
