"""``mode=emulate``: only the sandbox ranks run; the assistant serves the virtual ranks'
recorded data; the report and the prediction follow. Also the slice runs of calibration
(``quiet``: no report)."""

from __future__ import annotations

import datetime
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from prism_launch.config import Mode, Timing, VirtualHost
from prism_launch.config.plan import EmulatePlan, PrefetchPlan, RankPlan
from prism_launch.errors import (
    PrismError, RunFailedError, TraceMismatchError, TraceMissingError, reads_out_of_memory,
)
from prism_launch.config.registry import output_args
from prism_launch.launch.args_match import compare_args
from prism_launch.modes.context import RunContext, program_config
from prism_launch.trace import RankLogs, TraceReader
from prism_launch.trace import fingerprint as fp
from prism_launch.trace.signing import object_trust
from nccl_ext.core.ranklist import short_ranks


def open_trace(ctx: RunContext) -> TraceReader:
    """The run's trace, refused (naming what differs and how to capture again) when it was
    recorded for another program, config or library versions."""
    try:
        reader = TraceReader(ctx.trace.root, hint=ctx.capture_command())
    except TraceMissingError as e:
        others = [] if ctx.cfg.trace.dir else _same_script_traces(ctx.trace.root)
        if not others:
            raise
        raise TraceMissingError(e.path, hint=e.hint, reason=(
            f"{e.reason or 'no trace'}; this folder's name keys the script, its arguments (output-only flags' "
            f"values aside) and the config, and other traces of the same script lie beside it: "
            f"{', '.join(p.name for p in others[:5])}{' ...' if len(others) > 5 else ''}. One captured with "
            "other values of a flag declared output-only only now is used with trace.dir=<it>")) from None
    recorded = reader.manifest.fingerprint
    extra = reader.manifest.extra or {}
    # the arguments: the recorded ones against today's under today's output-only flags (a flag
    # declared output-only only now may differ); a trace without them, by the capture's digest
    mismatch = None
    if extra.get("script_args") is not None:
        mismatch = compare_args(extra["script_args"], ctx.program.args, output_args(ctx.cfg.trace.ignore_args),
                                ctx.cfg.trace.ignore_args)
        args_differ = mismatch is not None
    else:
        args_differ = recorded.get("args") != ctx.fingerprint["args"]
    differs = [k for k in ("config", "script", "args", "versions")
               if (args_differ if k == "args" else recorded.get(k) != ctx.fingerprint[k])]
    if differs:
        details = []
        if "args" in differs:
            details.append(mismatch.describe() if mismatch is not None else
                           "script args differ from the capture's (its trace does not record them)")
        if "config" in differs:
            details.append(f"config: recorded {extra.get('program_config')} vs now {program_config(ctx.cfg)}")
        if "versions" in differs:
            details.append(f"versions: recorded {reader.manifest.versions} vs now {fp.versions()}")
        if "script" in differs:
            details.append(f"script: {ctx.program.script} changed since the capture")
        raise TraceMismatchError(f"trace {ctx.trace.root} was captured for a different {', '.join(differs)}; "
                                 + "; ".join(details) + f". Capture again: {ctx.capture_command()}")
    return reader


def _same_script_traces(root: Path) -> list[Path]:
    """Traces beside a default trace folder (``<script stem>-<key>``) of the same script stem."""
    stem = root.name.rpartition("-")[0]
    if not stem or not root.parent.is_dir():
        return []
    return sorted(p for p in root.parent.glob(f"{stem}-*")
                  if p != root and p.name.rpartition("-")[0] == stem and (p / "manifest.json").is_file())


def local_sandbox(ctx: RunContext) -> list[int]:
    """The sandbox ranks this physical node runs: the sandbox list split into
    ``physical.nodes`` contiguous chunks, in order."""
    sandbox, ph = list(ctx.cfg.sandbox.ranks), ctx.cfg.physical
    k, extra = divmod(len(sandbox), ph.nodes)
    start = ph.node_rank * k + min(ph.node_rank, extra)
    return sandbox[start : start + k + (ph.node_rank < extra)]


def trace_payload(reader: TraceReader) -> tuple[str, int]:
    """The trace's payload policy and carried-broadcast limit (traces before the policy, and
    ``exact`` traces before it was scoped to the sandbox ranks: ``full``)."""
    extra = reader.manifest.extra or {}
    policy = str(extra.get("payload", "full"))
    if policy == "exact" and extra.get("payload_ranks") is None:
        policy = "full"
    return policy, int(extra.get("carry_bytes", 0))


def trace_scope(reader: TraceReader) -> list[int] | None:
    """The sandbox ranks a ``capture.payload=exact`` trace stores payloads for (None: any)."""
    ranks = (reader.manifest.extra or {}).get("payload_ranks")
    return None if ranks is None else [int(r) for r in ranks]


def uncovered(ctx: RunContext, reader: TraceReader, ranks: list[int] | None = None, why: str = "") -> str | None:
    """Why the trace cannot serve ``ranks`` (default: ``sandbox.ranks``) as sandbox ranks, or None.
    An exact trace stores only what the sandbox ranks named at its capture consume."""
    scope = trace_scope(reader)
    ranks = sorted(set(ctx.cfg.sandbox.ranks if ranks is None else ranks))
    if scope is None or ranks == scope:
        return None
    return (f"the trace {ctx.trace.root} was captured with capture.payload=exact for sandbox ranks {scope}: it "
            f"stores only the tensors those ranks consume, so it cannot replay sandbox ranks {ranks}{why}. Capture "
            f"again with sandbox.ranks={ranks} ({ctx.capture_command()}), or with capture.payload=full (every "
            "captured rank's tensors, any sandbox set); mode=auto captures again by itself")


def emulate_plan(ctx: RunContext, local: list[int], store: str | None, schedule: Path | None,
                 payload: tuple[str, int] = ("exact", 0)) -> RankPlan:
    cfg, node = ctx.cfg, ctx.cfg.physical.node_rank
    em, pf = cfg.emulate, cfg.emulate.prefetch
    synthesized = payload[0] == "none"  # nothing recorded to serve: no assistant, no device data path
    assistant = em.virtual_host is VirtualHost.assistant and not synthesized
    section = EmulatePlan(
        trace_dir=str(ctx.trace.root), sandbox=tuple(cfg.sandbox.ranks), timing=str(em.timing),
        time_scale=em.time_scale, strict=em.strict, check=em.check_divergence,
        data_path="host" if synthesized else str(em.data_path),
        prefetch=PrefetchPlan(mode=str(pf.mode), pool_bytes=pf.pool_mib << 20, grow=pf.grow,
                              reserve_bytes=int(pf.reserve_gib * 2**30), threads=pf.threads,
                              host_tier_bytes=int(pf.host_tier_gib * 2**30)),
        pruned=em.pruned_rings and not synthesized, ring_backend=str(em.ring_backend), ring_tags=em.ring_tags, assistant=assistant,
        window=em.window, store=store, schedule_file=str(schedule) if schedule else None,
        summary_files={r: str(ctx.report.summary(r, node)) for r in local}, payload=payload[0],
        carry_bytes=payload[1],
        assistant_summary=str(ctx.report.assistant_summary(node)) if assistant else None,
        divergence_rtol=em.divergence_rtol, host_scalar_sites=tuple(em.host_scalar_sites),
        host_scalar_max_elements=em.host_scalar_max_elements, kernel_profile=ctx.profile_kernels,
    )
    limit = int(cfg.cluster.gpu_memory_gib * 2**30) if cfg.memory.enforce_limit else 0
    return replace(ctx.base_plan(Mode.emulate, local), memory_limit_bytes=limit, emulate=section)


def emulate(ctx: RunContext, reader: TraceReader, *, quiet: bool = False) -> Path:
    """Run the sandbox ranks against the trace; write the report (unless ``quiet``); returns
    the run's log directory."""
    import torch.distributed as dist

    from prism_launch.report.build import build_report

    cfg = ctx.cfg
    sandbox = list(cfg.sandbox.ranks)
    missing = [r for r in sandbox if r not in reader.manifest.ranks_captured]
    if missing:
        raise PrismError(
            f"sandbox.ranks {missing} are not in the trace {ctx.trace.root} (a folded capture holds only the "
            f"ranks closed under its sandbox ranks' model-parallel groups); capture around them: "
            f"{ctx.capture_command()} with sandbox.ranks={sandbox}, or use mode=auto")
    refused = uncovered(ctx, reader)
    if refused:
        raise PrismError(refused)
    ph = cfg.physical
    local = local_sandbox(ctx)
    summaries = ctx.report.summaries(ph.node_rank)
    payload = trace_payload(reader)
    assistant = cfg.emulate.virtual_host is VirtualHost.assistant and payload[0] != "none"
    timeout = datetime.timedelta(seconds=cfg.comm.timeout_s)
    from prism_launch.launch import store as stores

    store, endpoint, prefix = None, None, ""
    if ph.nodes > 1:  # node 0 hosts the store every node's sandbox ranks rendezvous through
        host, port = ph.endpoint.rsplit(":", 1)
        store = stores.network_store(host, int(port), master=ph.node_rank == 0, timeout=timeout)
        endpoint = ph.endpoint
        prefix = stores.run_prefix(store, master=ph.node_rank == 0, manifest=ctx.trace.manifest, timeout=timeout)
    elif len(sandbox) + assistant > 1:  # listening on loopback only
        store = stores.loopback_store(timeout)
        endpoint, prefix = f"127.0.0.1:{store.port}", stores.random_prefix()
    if store is not None:
        store = dist.PrefixStore(prefix, store)
    for old in summaries.glob("*.json") if summaries.exists() else ():
        old.unlink()
    schedule = None
    if cfg.emulate.timing is Timing.predicted:
        from nccl_ext.core.atomic import atomic_write_text
        from prism_launch.predict.prediction import schedule as predicted_schedule

        schedule = ctx.report.schedule(ph.node_rank)
        schedule.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(schedule, json.dumps(predicted_schedule(cfg, reader, ctx.trace)))
    log_dir = ctx.log_dir(Mode.emulate)
    plan = emulate_plan(ctx, local, endpoint, schedule, payload)
    plan = replace(plan, emulate=replace(plan.emulate, store_prefix=prefix, loopback=ph.nodes == 1))
    trusted, note = object_trust(reader.authorship(), cfg.trace.trusted, ctx.trace.root)
    if note:
        print(f"prism-launch: {note}", file=sys.stderr)
    plan = replace(plan, emulate=replace(plan.emulate, trusted_objects=trusted))
    extra = [ctx.agent.assistant_spec(plan, log_dir)] if assistant and ph.node_rank == 0 else []
    t0 = time.monotonic()
    oom = None
    try:
        ctx.agent.run(plan, log_dir=log_dir, extra_specs=extra)
    except RunFailedError:
        # running out of memory at the target's limit is a finding, not a crash: report it
        oom = None if ph.nodes > 1 else sandbox_oom(log_dir, local)
        if oom is None:
            raise
        oom["limit_bytes"] = plan.memory_limit_bytes or None
    if ph.nodes > 1:
        exchange_summaries(ctx, store, sandbox, local)
    wall = time.monotonic() - t0
    del store
    if ph.node_rank != 0:
        print(f"prism-launch: node {ph.node_rank} ran sandbox ranks {local}; the report is written by node 0",
              file=sys.stderr)
    elif not quiet or oom is not None:
        report = build_report(cfg, reader, ctx.trace, ctx.report, sandbox, log_dir, wall, sandbox_oom=oom)
        if oom is not None:
            raise RunFailedError(
                f"{oom['message']}\nthe sandbox ran out of memory at the target's limit "
                f"(cluster.gpu_memory_gib={cfg.cluster.gpu_memory_gib:g}); predicted OOM ranks: "
                f"{short_ranks(report['predicted']['oom_ranks'])}; report: {ctx.report.report_json}")
    return log_dir


def sandbox_oom(log_dir: Path, ranks: list[int]) -> dict | None:
    """The first sandbox rank whose error file says it ran out of memory, if any (the
    assistant failing because that rank stopped early is a consequence, not the cause)."""
    for r in ranks:
        try:
            msg = json.loads(RankLogs(log_dir).error_file(r).read_text()).get("message", "")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(msg, dict):  # torchelastic's error file nests {"message": ..., "extraInfo": ...}
            msg = msg.get("message", "")
        text = msg if isinstance(msg, str) else json.dumps(msg)
        if reads_out_of_memory(text):
            return {"rank": r, "message": f"rank {r}: {text.splitlines()[0]}"}
    return None


def exchange_summaries(ctx: RunContext, store, sandbox: list[int], local: list[int]) -> None:
    """Other nodes hand their sandbox ranks' summaries to node 0 through the store."""
    node = ctx.cfg.physical.node_rank
    if node != 0:
        for r in local:
            path = ctx.report.summary(r, node)
            store.set(f"prism/summary/{r}", path.read_text() if path.exists() else "")
        return
    from nccl_ext.core.atomic import atomic_write_text

    remote = [r for r in sandbox if r not in local]
    keys = [f"prism/summary/{r}" for r in remote]
    timeout_s = ctx.cfg.comm.timeout_s
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - c10d raises its own error types
        late = [r for r, k in zip(remote, keys) if not store.check([k])]
        raise RunFailedError(f"node 0: sandbox ranks {late} on other nodes never reported within "
                             f"comm.timeout_s={timeout_s:g}s ({e})") from None
    for r, key in zip(remote, keys):
        text = store.get(key).decode()
        if text:
            atomic_write_text(ctx.report.summary(r), text)
