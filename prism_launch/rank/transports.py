"""The transport a rank's prism process group talks through, built from its rank plan:
the capture coordinator's connection, the group-discovery recorder, or the replay of the
virtual ranks (with its physical group, pruned rings and device data path)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from prism_launch.config.plan import RankPlan
from prism_launch.trace import TraceLayout, TraceReader

MakeTransport = Callable[[int, int, float], object]


def capture(plan: RankPlan) -> MakeTransport:
    from nccl_ext.capture.transport import CaptureTransport

    cp = plan.capture

    def make(rank: int, world_size: int, timeout_s: float):
        if cp.switch_interval_us:
            import sys

            sys.setswitchinterval(cp.switch_interval_us * 1e-6)
        captured = frozenset(cp.captured) if cp.captured is not None else None
        return CaptureTransport(cp.coordinator, bytes.fromhex(cp.authkey), rank, timeout_s, captured=captured,
                                payload=cp.payload, carry_bytes=cp.carry_bytes, exchange=cp.exchange,
                                gpu_exchange_bytes=cp.gpu_exchange_bytes, gpu_waits=cp.gpu_waits,
                                fold_exchange=cp.fold_exchange,
                                scope=frozenset(cp.scope) if cp.scope is not None else None)

    return make


def discover(plan: RankPlan) -> MakeTransport:
    from nccl_ext.capture.discover import DiscoverTransport

    def make(rank: int, world_size: int, timeout_s: float):
        return DiscoverTransport(plan.capture.discover_file)

    return make


def physical_group(plan: RankPlan, index: int, size: int, timeout_s: float):
    """The gloo group of the emulation's physical processes (sandbox ranks, then the assistant),
    met through node 0's store (``physical.endpoint`` on several nodes). Both the store's
    connection and the group's forming end by ``timeout_s`` (``comm.timeout_s``); a process
    that never arrives (its node's prism-launch not started, or started with other
    ``physical.*`` values) fails every one that did, naming it. Where every member arrived and
    gloo's full mesh still failed, every member tries again (:func:`_connected`)."""
    if size < 2:
        return None, None
    import datetime

    import torch.distributed as dist

    from nccl_ext.core.errors import CommDeadlineError, first_line
    from nccl_ext.core.pending import LIMIT_KEY
    from nccl_ext.core.ranklist import short_ranks

    e = plan.emulate
    who = f"sandbox rank {e.sandbox[index]}" if index < len(e.sandbox) else "the assistant"
    host, port = e.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    if getattr(e, "loopback", False):  # getattr: stand-ins of the plan in tests name only what they set
        gloo_on_loopback()
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - c10d raises its own error types
        raise CommDeadlineError(
            f"{who}: could not reach the run's store at {e.store} (node 0's prism-launch hosts it; "
            f"physical.endpoint on several nodes) within {timeout_s:g} s: {first_line(exc)}; start node 0, or "
            f"raise {LIMIT_KEY}=") from exc
    if getattr(e, "store_prefix", ""):  # the run's keys, which one who reaches the store without the plan cannot name
        store = dist.PrefixStore(e.store_prefix, store)
    store.set(_arrived_key(index), "1")
    try:
        group = _connected(dist, store, index, size, timeout)
    except Exception as exc:  # noqa: BLE001 - c10d raises its own error types
        missing = [i for i in range(size) if not store.check([_arrived_key(i)])]
        names = [f"sandbox rank {e.sandbox[i]}" if i < len(e.sandbox) else "the assistant" for i in missing]
        here = ", ".join(map(str, plan.local_ranks))
        if not missing:
            raise CommDeadlineError(
                f"{who}: every member of the physical group (sandbox ranks {short_ranks(e.sandbox)}"
                f"{' + the assistant' if size > len(e.sandbox) else ''}) arrived, but connecting them failed: "
                f"{first_line(exc)}. A member that exited while the group formed closes its connections: see "
                "the other ranks' logs (and the assistant's); if none failed, run again") from exc
        raise CommDeadlineError(
            f"{who}: the physical group (sandbox ranks {short_ranks(e.sandbox)}"
            f"{' + the assistant' if size > len(e.sandbox) else ''}) did not form within {timeout_s:g} s: "
            f"{', '.join(names) or 'no one'} (physical rank(s) {missing}) never arrived. This node runs sandbox "
            f"rank(s) {here or '-'}; ranks of other physical nodes come from their own prism-launch, started with "
            f"the same physical.nodes and physical.endpoint and its physical.node_rank; or raise {LIMIT_KEY}= "
            f"({first_line(exc)})") from exc
    return group, store


def gloo_on_loopback() -> None:
    """Every gloo group this process forms from here on (the physical group, the pruned rings)
    listens on the loopback interface: a single-node run's members are all on this host, and
    gloo otherwise listens on the interface the host name resolves to. A
    ``GLOO_SOCKET_IFNAME`` the user set is kept."""
    import os

    if not os.environ.get("GLOO_SOCKET_IFNAME") and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # read by ProcessGroupGloo's constructor


CONNECT_ATTEMPTS = 3
"""Times the physical group tries to connect its members when gloo's full mesh fails with every
member present (on a loaded machine one pair's connection is at times closed while it forms)."""


def _connected(dist, store, index: int, size: int, timeout):
    """The gloo group of the ``size`` members, formed anew — by every member — while gloo's full
    mesh fails for any of them, at most :data:`CONNECT_ATTEMPTS` times: after each try a member
    says on the store whether it connected and waits for the others' word (a member that
    connected drops its group when another did not). Raises the last failure."""
    for attempt in range(CONNECT_ATTEMPTS):
        group, failure = None, None
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"prism/physical/{attempt}", store), index, size, timeout)
        except Exception as exc:  # noqa: BLE001 - c10d raises its own error types
            failure = exc
        if failure is not None and not store.check([_arrived_key(i) for i in range(size)]):
            raise failure  # a member never arrived: no other try brings it
        store.set(f"prism/physical-connected/{attempt}/{index}", "0" if failure else "1")
        keys = [f"prism/physical-connected/{attempt}/{i}" for i in range(size)]
        try:  # a member whose try failed at once waits for one still in its own (up to ``timeout``)
            store.wait(keys, 2 * timeout)
        except Exception:  # noqa: BLE001 - a member never said: it is gone, and this try's failure says why
            if failure is None:
                raise
            raise failure from None
        if all(store.get(k) == b"1" for k in keys):
            return group
        if attempt == CONNECT_ATTEMPTS - 1:
            raise failure or RuntimeError(f"another member of the physical group could not connect to it "
                                          f"({CONNECT_ATTEMPTS} tries)")
        del group
    raise AssertionError("unreachable")


def _arrived_key(index: int) -> str:
    return f"prism/physical-arrived/{index}"


def ring_channels(plan: RankPlan, me: int, store, timeout_s: float):
    """The pruned rings' communicators of physical rank ``me`` (gloo, or NCCL on this
    process's current GPU; without ring tags messages match by issue order)."""
    from nccl_ext.pruning.rings import RingChannels, group_factory

    e = plan.emulate
    device = None
    if e.ring_backend == "nccl":
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
    return RingChannels(group_factory(store, me, e.ring_backend, timeout_s), tags=e.ring_tags, device=device,
                        timeout_s=timeout_s)


def outlive_interpreter(*objs) -> None:
    """Keep c10d objects (the physical group, its store, the ring groups) alive past interpreter
    teardown: the process's exit releases them, so no c10d destructor (which waits on the
    group's queued work and joins its threads) runs while Python finalizes, as the other
    physical processes close their connections. (The aborts at exit once blamed on these
    objects came from the transport's own threads: ``nccl_ext/core/threads.py``.)"""
    import ctypes

    for o in objs:
        if o is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))


def load_schedule(plan: RankPlan) -> dict[int, list[float]] | None:
    path = plan.emulate.schedule_file
    if not path:
        return None
    return {int(r): v for r, v in json.loads(Path(path).read_text()).items()}


def replay(plan: RankPlan) -> MakeTransport:
    from nccl_ext.replay.transport import ReplayTransport
    from prism_launch.rank.replay_source import TraceRecording

    e = plan.emulate

    def make(rank: int, world_size: int, timeout_s: float):
        sandbox = e.sandbox
        physical, store = physical_group(plan, sandbox.index(rank), len(sandbox) + e.assistant, timeout_s)

        def on_close() -> None:
            if e.assistant:
                from nccl_ext.replay.assistant import done_key

                store.set(done_key(rank), "1")
        reader = TraceReader(e.trace_dir, verify=False)  # verified once by the launcher
        recording = TraceRecording(reader, load_schedule(plan))
        device_path = None
        if e.data_path == "device":
            from nccl_ext.device_path import DevicePath

            pf = e.prefetch
            device_path = DevicePath(
                rank=rank, sandbox=sandbox, recording=recording, mode=pf.mode, pool_bytes=pf.pool_bytes,
                check=e.check, timeout_s=timeout_s, device_kind="cuda" if plan.device == "cuda" else "cpu",
                workers=pf.threads, host_tier_bytes=pf.host_tier_bytes, grow=pf.grow,
                expected_peak=captured_peak(reader, rank), reserve_bytes=pf.reserve_bytes,
                share=gpu_sharers(plan, rank), memory_limit_bytes=plan.memory_limit_bytes)
            device_path.prepare()  # plan and fill the host tier while the program builds its model
        rings = None
        if e.pruned and store is not None:
            from nccl_ext.pruning.rings import ring_plan

            me = sandbox.index(rank)
            rings = ring_channels(plan, me, store, timeout_s)
            rings.open(ring_plan(recording, sandbox, me, len(sandbox) if e.assistant else None))
        outlive_interpreter(physical, store, rings)
        return ReplayTransport(
            rank=rank, sandbox=sandbox, recording=recording, timeout_s=timeout_s, device_path=device_path,
            pruned=e.pruned, rings=rings, physical=physical, assistant=len(sandbox) if e.assistant else None,
            on_close=on_close, timing=e.timing, time_scale=e.time_scale, strict=e.strict, check=e.check,
            summary_path=plan.summary_file(rank), payload=e.payload, carry_bytes=e.carry_bytes, divergence_rtol=e.divergence_rtol,
            host_scalar_sites=e.host_scalar_sites, host_scalar_max_elements=e.host_scalar_max_elements,
        )

    return make


def gpu_sharers(plan: RankPlan, rank: int) -> int:
    """How many of this node's processes the launcher put on this process's GPU (slots are
    dealt round-robin over the GPUs present)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return 1
    slot, slots = plan.device_slot(rank), len(plan.local_ranks)
    return max(1, sum(1 for j in range(slots) if j % n == slot % n))


def captured_peak(reader: TraceReader, rank: int) -> int | None:
    """The capture's peak memory of ``rank`` (the largest captured rank's when the rank was
    folded into another), or None when the trace has no memory record."""
    if TraceLayout.MEMORY not in reader.json_files():
        return None
    peaks = {int(r): m.get("peak_bytes") for r, m in reader.read_json(TraceLayout.MEMORY).items()}
    peaks = {r: p for r, p in peaks.items() if p is not None}
    if not peaks:
        return None
    return int(peaks.get(rank, max(peaks.values())))
