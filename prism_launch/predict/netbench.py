"""Measure the α (per-hop latency) and bandwidth of the link between ranks on this
machine and write them as a ``cluster`` config.

    python -m prism_launch.predict.netbench [--nproc 2] [--sizes 1K,4K,...,16M] [--iters 20]
                                    [--name local] [--out configs/cluster/local.yaml]
                                    [--gpus-per-node N] [--memory-gib G] [--fit KIND]

``nproc`` worker processes are started here (backend ``nccl`` when CUDA is available,
``gloo`` over loopback otherwise), meeting at a rendezvous store the launcher hosts on
a port of 127.0.0.1 the OS picks. At every size the workers run warm-up and then timed
iterations of all_reduce, all_gather, reduce_scatter, broadcast and a send/recv ping-pong
(p2p: half the round trip), back to back with a barrier between measurements; an op's
time is the slowest rank's mean over iterations, as nccl-tests reports it, because a
job's step pays the mean: on a shared CPU host gloo's times are heavy-tailed (2 processes
on the 2-core VM: 64 KiB all-reduces median 0.65 ms, mean 1.9 ms, p90 4.1 ms), and a
median prices a job's many small collectives at a fraction of what they cost it. The iterations are split into
``--rounds`` passes over every (op, size), so a passing slow phase of the machine does
not bias one series. Buffers for every size stay allocated: about (nproc + 4) × the sum
of the sizes per process.

Each op's times are fitted with :func:`prism_launch.predict.link_fit.fit_alpha_beta`, and all of
them jointly with :func:`~prism_launch.predict.link_fit.fit_link`; ``--fit`` picks the fit that is
written (default all_reduce, the op whose bus bandwidth nccl-tests quotes and which
carries data-parallel gradients). The launch overhead is folded into the per-hop
latency, so ``protocol_latency_us`` is written as 0. A table of measured vs predicted
times is printed and the cluster YAML is written atomically (temporary file + rename).

Everything measured here is one link class, so ``intra_node`` is the fit and
``inter_node`` is a copy of it unless ``--inter-bandwidth-gbps`` / ``--inter-latency-us``
give the network's figures.

Every wait is bounded by ``--timeout`` (the process group's timeout and the launcher's
wait for results and exits); a failing worker's traceback is reported and the exit
status is non-zero; workers are reaped on every path and leave on their own if the
launcher disappears.

Sizes follow the cost model's convention (``prism_launch/predict/cost_model.py``): the buffer of one
member for all_reduce/broadcast/send, one member's contribution for all_gather.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import queue
import re
import shlex
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from prism_launch.errors import NetbenchError
from prism_launch.predict.cost_model import (
    ClusterSpec,
    FabricSpec,
    KindCost,
    LinkSpec,
    NcclCostModel,
    bus_bandwidth_gbps,
    preset_dir,
)
from prism_launch.predict.link_fit import fit_alpha_beta, fit_link, kind_costs, round_sig as _round_sig

DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M"
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
ELEMENT_BYTES = 4  # float32 payloads
_UNITS = {"": 1, "B": 1}
_UNITS.update({f"{u}{suffix}": 1 << (10 * (i + 1)) for i, u in enumerate("KMG") for suffix in ("", "B", "IB")})


# --------------------------------------------------------------------------- arguments


def parse_size(text: str) -> int:
    """``"64K"`` → 65536 (binary units: K, M, G; optional B/iB suffix)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 4096, 64K, 16M)")
    n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if n < ELEMENT_BYTES or n % ELEMENT_BYTES:
        raise argparse.ArgumentTypeError(
            f"size {text!r} must be a positive multiple of {ELEMENT_BYTES} bytes (float32 elements)"
        )
    return n


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({parse_size(t) for t in text.split(",") if t.strip()})
    if len(sizes) < 2:
        raise argparse.ArgumentTypeError("--sizes needs at least two distinct sizes to fit latency and bandwidth")
    return sizes


def _oversubscription(text: str) -> float:
    value = float(text)
    if not (value >= 1.0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1.0 (leaf down/up ratio), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {v})")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be > 0 (got {v})")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m prism_launch.predict.netbench",
        description="Measure α/β between ranks on this machine and write a cluster config.",
    )
    add = ap.add_argument
    add("--nproc", type=_positive_int, default=2, help="worker processes (>= 2; default 2)")
    add("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
        help=f"comma-separated sizes in bytes, K/M/G binary units (default {DEFAULT_SIZES})")
    add("--iters", type=_positive_int, default=20,
        help="timed iterations per op and size, rounded up to a multiple of --rounds (default 20)")
    add("--rounds", type=_positive_int, default=3,
        help="passes over all ops and sizes the iterations are split into (default 3)")
    add("--warmup", type=int, default=3, help="untimed iterations before them (default 3)")
    add("--name", default="local", help="cluster name written in the YAML (default local)")
    add("--out", type=Path, default=preset_dir() / "local.yaml",
        help="YAML to write (default configs/cluster/local.yaml of this checkout, where the `cluster`"
        " config group is read from; '-' for none)")
    add("--gpus-per-node", type=_positive_int, default=None, help="gpus_per_node to write (default: --nproc)")
    add("--memory-gib", type=_positive_float, default=None,
        help="gpu_memory_gib to write (default: the GPU's memory, or RAM / nproc on CPU)")
    add("--nics-per-node", type=_positive_int, default=1, help="nics_per_node to write (default 1)")
    add("--inter-bandwidth-gbps", type=_positive_float, default=None,
        help="inter_node bandwidth per NIC in GB/s (default: the measured one)")
    add("--inter-latency-us", type=float, default=None, help="inter_node per-hop latency (default: the measured one)")
    add("--nodes-per-leaf", type=_positive_int, default=32,
        help="fabric.nodes_per_leaf to write: nodes whose same-rail NICs share a leaf switch (default 32)")
    add("--oversubscription", type=_oversubscription, default=1.0,
        help="fabric.oversubscription to write: leaf down/up bandwidth ratio, >= 1 (default 1.0)")
    add("--fit", choices=(*KINDS, "all"), default="all_reduce",
        help="measurements the written link is fitted to: one op, or all of them jointly (default all_reduce)")
    add("--kinds", choices=("auto", "on", "off"), default="auto", help="also write each collective kind's own fit "
        "as cluster.kinds (auto, the default: with gloo, whose kinds differ by more than hops and bytes)")
    add("--comment", action="append", default=[], help="extra line for the YAML's header comment (repeatable)")
    add("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="default: nccl with CUDA, else gloo")
    add("--timeout", type=_positive_float, default=300.0,
        help="seconds for the whole run and any single wait (default 300)")
    return ap


# --------------------------------------------------------------------------- worker


@dataclass(frozen=True, slots=True)
class _Plan:
    world: int
    sizes: tuple[int, ...]
    iters: int
    rounds: int
    warmup: int
    backend: str
    store_port: int
    timeout_s: float
    parent_pid: int
    gloo_ifname: str


def _watch_parent(parent_pid: int) -> None:
    """Exit when the launcher is gone, so a killed launcher leaves no worker behind."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def _worker(rank: int, plan: _Plan, results) -> None:
    threading.Thread(target=_watch_parent, args=(plan.parent_pid,), daemon=True).start()
    try:
        out = _measure(rank, plan)
        if rank == 0:
            results.put(("ok", rank, out))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        results.close()
        results.join_thread()  # the report must leave before the process does
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _measure(rank: int, plan: _Plan) -> dict[tuple[str, int], float]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if plan.gloo_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = plan.gloo_ifname
    timeout = _dt.timedelta(seconds=plan.timeout_s)
    store = dist.TCPStore("127.0.0.1", plan.store_port, plan.world, False, timeout=timeout)
    if plan.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(plan.backend, store=store, rank=rank, world_size=plan.world, timeout=timeout)
    try:
        return _run_ops(rank, plan, device)
    finally:
        dist.destroy_process_group()


def _run_ops(rank: int, plan: _Plan, device) -> dict[tuple[str, int], float]:
    import torch
    import torch.distributed as dist

    world = plan.world
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    # p2p: ping-pong between rank pairs (0↔1, 2↔3, ...); a rank left without a partner
    # idles. Half the round trip is one transfer. (A simultaneous two-way exchange over
    # gloo stalls for milliseconds at random, which says nothing about the link.)
    partner = rank + 1 if rank % 2 == 0 else rank - 1
    points: list[tuple[str, int, object]] = []
    for nbytes in plan.sizes:
        numel = nbytes // ELEMENT_BYTES
        buf = torch.zeros(numel, dtype=torch.float32, device=device)  # sums stay 0 however often reduced
        gathered = torch.empty(numel * world, dtype=torch.float32, device=device)
        recv = torch.empty(numel, dtype=torch.float32, device=device)
        shard = torch.empty(max(1, numel // world), dtype=torch.float32, device=device)
        scattered = torch.zeros(shard.numel() * world, dtype=torch.float32, device=device)  # the size, as p chunks

        def p2p(buf=buf, recv=recv) -> None:
            if partner >= world:
                return
            if rank % 2 == 0:
                dist.send(buf, partner)
                dist.recv(recv, partner)
            else:
                dist.recv(recv, partner)
                dist.send(buf, partner)

        ops = {
            "all_reduce": lambda buf=buf: dist.all_reduce(buf),
            "all_gather": lambda buf=buf, out=gathered: all_gather(out, buf),
            "reduce_scatter": lambda out=shard, whole=scattered: reduce_scatter(out, whole),
            "broadcast": lambda buf=buf: dist.broadcast(buf, 0),
            "p2p": p2p,
        }
        points.extend((kind, nbytes, ops[kind]) for kind in KINDS)

    for _, _, op in points:
        for _ in range(plan.warmup):
            op()
    sync()
    # nccl-tests style: back-to-back iterations of one (op, size) after a barrier, each
    # iteration timed. The sweep over all points is repeated `rounds` times so that a
    # passing slow phase of the machine touches every point alike instead of one whole
    # series; an op's time is the slowest rank's mean (nccl-tests' way: a maximum per iteration
    # would charge every op the worse of the ranks' independent stalls).
    per_round = -(-plan.iters // plan.rounds)
    durations = torch.zeros(plan.rounds * per_round, len(points), dtype=torch.float64)
    for rnd in range(plan.rounds):
        for j, (_, _, op) in enumerate(points):
            dist.barrier()
            stamps = [time.perf_counter()]
            for _ in range(per_round):
                op()
                sync()
                stamps.append(time.perf_counter())
            for i in range(per_round):
                durations[rnd * per_round + i, j] = stamps[i + 1] - stamps[i]
    means = durations.mean(dim=0).to(device)
    dist.all_reduce(means, op=dist.ReduceOp.MAX)
    means = means.cpu()
    results = {
        (kind, nbytes): float(means[j]) * (0.5 if kind == "p2p" else 1.0)  # p2p: half the round trip
        for j, (kind, nbytes, _) in enumerate(points)
    }
    return results


# --------------------------------------------------------------------------- launcher


def _free_store(timeout_s: float):
    import torch.distributed as dist

    # The launcher hosts the rendezvous store on a port the OS picks, so no port can be
    # taken by someone else between choosing it and using it.
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=_dt.timedelta(seconds=timeout_s), wait_for_workers=False)


def run_workers(
    nproc: int, sizes: list[int], iters: int, warmup: int, backend: str, timeout_s: float, rounds: int = 3
) -> dict[tuple[str, int], float]:
    """Start the workers, wait (bounded) for rank 0's measurements, reap every process."""
    import multiprocessing as mp

    if nproc < 2:
        raise NetbenchError("--nproc must be >= 2: a link needs two ends")
    # Keep gloo on loopback unless the user chose an interface.
    loopback = backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and Path("/sys/class/net/lo").exists()
    store = _free_store(timeout_s)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    plan = _Plan(
        world=nproc,
        sizes=tuple(sizes),
        iters=iters,
        rounds=max(1, min(rounds, iters)),
        warmup=max(0, warmup),
        backend=backend,
        store_port=store.port,
        timeout_s=timeout_s,
        parent_pid=os.getpid(),
        gloo_ifname="lo" if loopback else "",
    )
    procs = [ctx.Process(target=_worker, args=(r, plan, results), name=f"netbench-{r}", daemon=True) for r in range(nproc)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        outcome = None
        while outcome is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NetbenchError(f"timed out after {timeout_s:.0f} s waiting for the workers' measurements")
            try:
                outcome = results.get(timeout=min(0.5, remaining))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode is not None for p in procs):
                    # Give a failing worker's traceback a moment to arrive before reporting.
                    try:
                        outcome = results.get(timeout=2.0)
                    except queue.Empty:
                        raise NetbenchError(
                            "worker(s) exited without a result: "
                            + ", ".join(f"rank {procs.index(p)} (exit code {p.exitcode})" for p in dead or procs)
                        ) from None
        status, rank, payload = outcome
        if status != "ok":
            raise NetbenchError(f"worker rank {rank} failed:\n{payload}")
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        late = [procs.index(p) for p in procs if p.is_alive()]
        if late:
            raise NetbenchError(f"worker rank(s) {late} did not exit after finishing")
        bad = [(procs.index(p), p.exitcode) for p in procs if p.exitcode != 0]
        if bad:
            raise NetbenchError("worker(s) ended with an error: " + ", ".join(f"rank {r} (exit code {c})" for r, c in bad))
        return payload
    finally:
        _reap(procs)
        results.close()
        results.join_thread()


def _reap(procs) -> None:
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)


# --------------------------------------------------------------------------- report


def fit_measurements(measured: dict[tuple[str, int], float], p: int) -> dict[str, LinkSpec]:
    """One :func:`fit_alpha_beta` per measured kind, plus the joint fit of all under ``"all"``."""
    fits: dict[str, LinkSpec] = {}
    for kind in KINDS:
        samples = sorted((n, t) for (k, n), t in measured.items() if k == kind)
        if samples:
            try:
                fits[kind] = fit_alpha_beta(samples, kind, p)
            except ValueError as e:
                print(f"netbench: warning: no fit for {kind}: {e}", file=sys.stderr)
    try:
        fits["all"] = fit_link((k, p, n, t) for (k, n), t in measured.items())
    except ValueError as e:
        print(f"netbench: warning: no joint fit: {e}", file=sys.stderr)
    return fits


def _fmt_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _model_time(link: LinkSpec, kind: str, nbytes: int, p: int) -> float:
    model = NcclCostModel(_cluster("fit", p, 1.0, link, link, 1))
    return model.p2p_time(nbytes, 0, 1) if kind == "p2p" else model.collective_time(kind, nbytes, list(range(p)))


def format_table(measured: dict[tuple[str, int], float], link: LinkSpec, fits: dict[str, LinkSpec], p: int) -> str:
    """Measured times against the written link's prediction and against each op's own fit."""
    lines = [
        f"{'op':<11} {'size':>6} {'measured us':>12} {'model us':>10} {'error':>7}"
        f" {'own fit us':>11} {'error':>7} {'busbw GB/s':>11}"
    ]
    for kind in KINDS:
        for (k, n), t in sorted(measured.items(), key=lambda kv: kv[0][1]):
            if k != kind:
                continue
            model = _model_time(link, kind, n, p)
            own = _model_time(fits[kind], kind, n, p) if kind in fits else math.nan
            lines.append(
                f"{kind:<11} {_fmt_size(n):>6} {t * 1e6:12.1f} {model * 1e6:10.1f} {(model - t) / t * 100:+6.1f}%"
                f" {own * 1e6:11.1f} {(own - t) / t * 100:+6.1f}% {bus_bandwidth_gbps(kind, n, p, t):11.3f}"
            )
    return "\n".join(lines)


def _cluster(name: str, gpus: int, mem: float, intra: LinkSpec, inter: LinkSpec, nics: int,
             fabric: FabricSpec | None = None, kinds: dict[str, KindCost] | None = None) -> ClusterSpec:
    return ClusterSpec(
        kinds=dict(kinds or {}),
        fabric=fabric or FabricSpec(),
        name=name,
        gpus_per_node=gpus,
        gpu_memory_gib=mem,
        intra_node=intra,
        inter_node=inter,
        nics_per_node=nics,
        protocol_latency_us=0.0,
    )


def default_memory_gib(backend: str, nproc: int) -> float:
    import torch

    if backend == "nccl" and torch.cuda.is_available():
        return round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1.0
    return max(0.1, math.floor(total / 2**30 / nproc * 10) / 10)


def cluster_yaml(spec: ClusterSpec, header: list[str]) -> str:
    from dataclasses import asdict

    from omegaconf import OmegaConf

    body = OmegaConf.to_yaml(OmegaConf.create(asdict(spec)), sort_keys=False)
    return "".join(f"# {line}\n" if line else "#\n" for line in header) + body


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`nccl_ext.core.atomic.atomic_write`); a
    cluster file is shared like any config: readable by all (0644)."""
    from nccl_ext.core.atomic import atomic_write

    atomic_write(path, text, mode=0o644)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        print("netbench: error: --backend nccl needs CUDA, which is not available here", file=sys.stderr)
        return 2
    if args.nproc < 2:
        print("netbench: error: --nproc must be >= 2 (a link needs two ends)", file=sys.stderr)
        return 2
    if backend == "nccl" and args.nproc > torch.cuda.device_count():
        print(f"netbench: error: --nproc {args.nproc} needs as many GPUs with nccl, "
              f"but {torch.cuda.device_count()} are visible", file=sys.stderr)
        return 2
    if args.inter_latency_us is not None and not (args.inter_latency_us >= 0 and math.isfinite(args.inter_latency_us)):
        print("netbench: error: --inter-latency-us must be >= 0", file=sys.stderr)
        return 2

    p = args.nproc
    print(f"netbench: {p} processes, backend {backend}, sizes {','.join(map(_fmt_size, args.sizes))}, "
          f"{args.warmup} warm-up + {args.iters} timed iterations", flush=True)
    started = time.monotonic()
    try:
        measured = run_workers(p, args.sizes, args.iters, args.warmup, backend, args.timeout, args.rounds)
        fits = fit_measurements(measured, p)
    except (NetbenchError, ValueError) as e:
        print(f"netbench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netbench: interrupted", file=sys.stderr)
        return 130
    if args.fit not in fits:
        print(f"netbench: error: the {args.fit} measurements could not be fitted; try larger --sizes or --fit all",
              file=sys.stderr)
        return 1

    chosen = fits[args.fit]
    link = LinkSpec(bandwidth_gbps=_round_sig(chosen.bandwidth_gbps), latency_us=_round_sig(chosen.latency_us))
    print()
    print(format_table(measured, link, fits, p))
    print()
    for kind, fit in fits.items():
        mark = "  <- written" if kind == args.fit else ""
        print(f"fit {kind:<11} latency {fit.latency_us:9.2f} us/hop   bandwidth {fit.bandwidth_gbps:9.3f} GB/s{mark}")
    print(f"measured in {time.monotonic() - started:.1f} s")

    inter = LinkSpec(
        bandwidth_gbps=args.inter_bandwidth_gbps if args.inter_bandwidth_gbps is not None else link.bandwidth_gbps,
        latency_us=args.inter_latency_us if args.inter_latency_us is not None else link.latency_us,
    )
    mem = args.memory_gib if args.memory_gib is not None else default_memory_gib(backend, p)
    kinds = kind_costs(fits) if args.kinds == "on" or (args.kinds == "auto" and backend == "gloo") else {}
    fabric = FabricSpec(nodes_per_leaf=args.nodes_per_leaf, oversubscription=args.oversubscription)
    spec = _cluster(args.name, args.gpus_per_node or p, mem, link, inter, args.nics_per_node, fabric, kinds)
    if str(args.out) == "-":
        return 0
    header = [
        f"Measured by `python -m prism_launch.predict.netbench {shlex.join(_without_comments(argv))}`",
        f"on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs, torch {torch.__version__}), "
        f"{_dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}:",
        f"{p} processes, backend {backend}{' over loopback' if backend == 'gloo' else ''}; "
        "all_reduce, all_gather, reduce_scatter, broadcast and send/recv ping-pong (p2p: half the round trip)",
        f"at {','.join(map(_fmt_size, args.sizes))} bytes;",
        f"time of an op: mean over {_total_iters(args)} back-to-back timed iterations"
        f" (in {min(args.rounds, args.iters)} rounds) "
        f"of the slowest rank (each rank's mean, then the largest), after {args.warmup} warm-up.",
        "intra_node: least-squares fit of latency per hop and bus bandwidth to "
        + ("the times of every op jointly," if args.fit == "all" else f"the {args.fit} times,"),
        "launch overhead folded into the per-hop latency (so protocol_latency_us is 0).",
        *(["kinds: each collective kind's own fit of the same form (gloo's differ by more than hops and bytes)."] * bool(kinds)),
        "inter_node: " + _inter_origin(args),
        "size curve (half_size_mib 0, curve_exponent 1): none, the alpha-beta fit above stands for it;"
        " nvls and sharp: false (not measured here);",
        f"fabric: {args.nodes_per_leaf} nodes per leaf, oversubscription {args.oversubscription:g} (as given).",
        *(line for text in args.comment for line in text.splitlines()),
    ]
    try:
        write_atomic(args.out, cluster_yaml(spec, header))
    except OSError as e:
        print(f"netbench: error: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


def _without_comments(argv: list[str] | None) -> list[str]:
    """The command line as given, less ``--comment`` (its text is in the header already)."""
    args = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--comment":
            skip = True
        elif not a.startswith("--comment="):
            out.append(a)
    return out


def _total_iters(args: argparse.Namespace) -> int:
    rounds = max(1, min(args.rounds, args.iters))
    return rounds * -(-args.iters // rounds)


def _inter_origin(args: argparse.Namespace) -> str:
    given = [f for f, v in (("bandwidth", args.inter_bandwidth_gbps), ("latency", args.inter_latency_us)) if v is not None]
    if not given:
        return "a copy of intra_node (nothing here was measured across machines)."
    rest = "" if len(given) == 2 else f"; {'latency' if given == ['bandwidth'] else 'bandwidth'} copied from intra_node"
    return f"{' and '.join(given)} given on the command line{rest}."


if __name__ == "__main__":
    sys.exit(main())
