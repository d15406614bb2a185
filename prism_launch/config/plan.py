"""The rank plan: everything the launcher tells a rank process, as one frozen value.

The launcher builds one :class:`RankPlan` per run from the resolved config and hands it to
every rank it starts (sandbox, captured or real ranks, and the assistant) in one environment
variable, :data:`PLAN_VAR`, next to torchrun's own ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` …
A rank reads nothing else of the project from its environment: every default is the
config's, resolved once by :func:`prism_launch.config.resolve`. Values that differ per rank
are looked up by logical rank (``device_slot``, ``summary_file``, ``memory_file``).
"""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

PLAN_VAR = "PRISM_PLAN"
"""The one variable of the rank contract: the plan's JSON, or ``@PATH`` of a file (mode 0600)
holding it when it is too long for one environment string or carries a secret (the capture's
authkey, the store's key prefix): a program's environment is often recorded (experiment
trackers log it) and handed to every process it starts."""

_INLINE_LIMIT = 96 * 1024  # Linux caps one environment string at 128 KiB (MAX_ARG_STRLEN)


@dataclass(frozen=True, kw_only=True, slots=True)
class CapturePlan:
    """A captured rank's connection to the coordinator (or the group discovery run)."""

    coordinator: str = ""
    """Unix socket address of the capture coordinator."""
    authkey: str = ""
    """Hex of the coordinator's authentication key."""
    captured: tuple[int, ...] | None = None
    """Folded capture: the logical ranks that run (a broadcast from any other root needs a stand-in)."""
    discover_file: str | None = None
    """Group discovery: run to the first communication op and write every ``new_group`` call here."""
    exchange: str | None = None
    """Directory of the shared-memory exchange (``payload`` exact/full: contributions to groups whose
    members are all captured are staged there and read by the peers; None: through the coordinator)."""
    payload: str = "exact"
    """The capture's resolved ``capture.payload`` policy (never ``auto``): ``exact`` or ``full``
    (contributions reach the coordinator, or the exchange where ``exchange`` is set; ``exact``
    keeps only what ``scope``'s ranks consume), or ``none`` (results synthesized on the rank;
    only metadata and carried broadcasts go to the coordinator)."""
    carry_bytes: int = 0
    """``payload=none``: broadcasts up to this size keep their real payload."""
    switch_interval_us: int = 0
    """Python's thread switch interval in the rank while it captures (0: Python's default)."""
    gpu_exchange_bytes: int = 0
    """Each rank's device buffer of the exchange on CUDA (:mod:`nccl_ext.exchange.ipc`; 0: off)."""
    gpu_waits: bool = False
    """Waits on the exchange's GPU ops are deferred to the GPU (:mod:`nccl_ext.capture.deferred_waits`)."""
    fold_exchange: bool = False
    """A folded group's weighted reductions are summed by its captured members (:mod:`nccl_ext.core.replica_sums`)."""
    scope: tuple[int, ...] | None = None
    """The ranks the trace is scoped to (``exact``: the sandbox ranks; None: every rank): the
    data of their ops is what the coordinator reads on the host."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefetchPlan:
    """``emulate.prefetch`` in bytes, for the device data path."""

    mode: str
    """``emulate.prefetch.mode``."""
    pool_bytes: int
    """``emulate.prefetch.pool_mib`` in bytes."""
    grow: bool
    """``emulate.prefetch.grow``."""
    reserve_bytes: int
    """``emulate.prefetch.reserve_gib`` in bytes."""
    threads: int
    """``emulate.prefetch.threads``."""
    host_tier_bytes: int
    """``emulate.prefetch.host_tier_gib`` in bytes (0: no host tier)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EmulatePlan:
    """What a sandbox rank (and the assistant) needs to replay the virtual ranks."""

    trace_dir: str
    """The trace being replayed."""
    sandbox: tuple[int, ...]
    """Every sandbox rank of the run, in order (all nodes)."""
    timing: str
    """``emulate.timing``: when virtual members arrive."""
    time_scale: float
    """``emulate.time_scale``: multiplier on replayed waits."""
    strict: bool
    """``emulate.strict``: a ``value`` divergence is an error."""
    check: bool
    """``emulate.check_divergence``: compare live contributions with the recorded ones."""
    data_path: str
    """``device`` or ``host`` (resolved)."""
    prefetch: PrefetchPlan
    """The device data path's prefetching."""
    pruned: bool
    """``emulate.pruned_rings``."""
    ring_backend: str
    """``emulate.ring_backend``: ``gloo`` or ``nccl``."""
    ring_tags: bool
    """``emulate.ring_tags``: ring messages matched by tag as well as order."""
    assistant: bool
    """An assistant process serves the virtual ranks (it is the last physical rank)."""
    window: int
    """``emulate.window``: ops per sandbox rank the assistant may stream ahead."""
    store: str | None = None
    """``host:port`` of the TCPStore the physical processes rendezvous through (None: one process)."""
    store_prefix: str = ""
    """The run's secret prefix of every store key (:mod:`prism_launch.launch.store`): one who
    reaches the store without it cannot name the run's keys."""
    loopback: bool = False
    """A single-node run: gloo listens on the loopback interface (unless ``GLOO_SOCKET_IFNAME``
    is set)."""
    schedule_file: str | None = None
    """Predicted issue times of every captured rank's events (``timing=predicted``)."""
    summary_files: dict[int, str] = field(default_factory=dict)
    """Where each sandbox rank of this node writes its summary."""
    kernel_profile: bool = False
    """A calibration slice's ranks list the kernels of their first steady step in their summaries
    (``calibrate.kernel_mix``; :mod:`prism_launch.rank.kernels`)."""
    divergence_rtol: float | None = None
    """``emulate.divergence_rtol`` (None: by dtype)."""
    host_scalar_sites: tuple[str, ...] = ()
    """``emulate.host_scalar_sites``."""
    host_scalar_max_elements: int = 64
    """``emulate.host_scalar_max_elements``."""
    assistant_summary: str | None = None
    """Where the assistant writes its streaming statistics (None: no assistant)."""
    payload: str = "exact"
    """The trace's payload policy (its manifest's): ``none`` synthesizes every result on the
    sandbox's device (no assistant, no device data path)."""
    carry_bytes: int = 0
    """``payload=none``: broadcasts up to this size carry their recorded payload."""
    trusted_objects: bool = False
    """Object collectives unpickle the trace's payloads as they are: the trace is signed by this
    user, or ``trace.trusted=true`` (else through an allow-list, :mod:`nccl_ext.frontend.safe_unpickle`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    mode: str
    """``real``, ``capture`` or ``emulate``."""
    device: str
    """``cpu`` or ``cuda`` (resolved)."""
    compat: tuple[str, ...] = ()
    """Modules whose ``install()`` runs first in every rank (CPU compatibility layers)."""
    probes: tuple[str, ...] = ()
    """Modules whose ``install()`` runs in a capturing rank (recorders of what no op carries)."""
    timeout_s: float
    """Deadline of every communication wait."""
    subgroups: str = "auto"
    """How sub-group creation reaches the prism process group (``comm.subgroups``)."""
    local_ranks: tuple[int, ...] = ()
    """The logical ranks this launcher starts, in device-slot order."""
    memory_track: bool = True
    """``memory.track``: allocator-level accounting in every rank."""
    memory_limit_bytes: int = 0
    """The target's memory cap on sandbox allocators (0: none)."""
    memory_cpu_hook: bool = True
    """``memory.cpu_hook``: count CPU allocations with the native hook."""
    memory_cache_dir: str | None = None
    """``memory.cache_dir``: where the built hook is cached (None: the default)."""
    memory_dir: str | None = None
    """``mode=real``: the run's log directory, where each rank writes its allocator summary
    (:meth:`prism_launch.trace.layout.RankLogs.memory`)."""
    local_rank_arg: bool = False
    """Prepend ``--local_rank=N`` to the script's arguments, as the deepspeed launcher does."""
    hook: bool = False
    """``--no-python``: the first Python interpreter of the command becomes the rank."""
    capture: CapturePlan | None = None
    """A captured rank's (or group discovery's) connection; None outside capture."""
    emulate: EmulatePlan | None = None
    """A sandbox rank's (or the assistant's) replay; None outside emulation."""

    # -- per-rank values ------------------------------------------------------------------
    def device_slot(self, rank: int | None) -> int:
        """This process's slot among the launcher's processes (GPU ``slot % GPUs``); the
        assistant (``rank=None``) takes the slot after the sandbox ranks'."""
        if rank is None or rank not in self.local_ranks:
            return len(self.local_ranks)
        return self.local_ranks.index(rank)

    def summary_file(self, rank: int) -> Path | None:
        e = self.emulate
        path = e.summary_files.get(rank) if e is not None else None
        return Path(path) if path else None

    # -- the contract ---------------------------------------------------------------------
    def secret(self) -> bool:
        """Whether the plan carries a secret (kept out of the environment where it can be)."""
        return bool((self.capture and self.capture.authkey) or (self.emulate and self.emulate.store_prefix))

    def to_env(self, spill_dir: Path | None = None) -> dict[str, str]:
        """``{PLAN_VAR: ...}``; a plan too long for one environment string, or one carrying a
        secret when ``spill_dir`` is given, goes to ``spill_dir/plan.json`` (mode 0600) and the
        variable holds ``@path``."""
        text = json.dumps(asdict(self), separators=(",", ":"))
        if len(text) <= _INLINE_LIMIT and (spill_dir is None or not self.secret()):
            return {PLAN_VAR: text}
        if spill_dir is None:
            raise ValueError(f"the rank plan is {len(text)} bytes, too long for the environment, and no "
                             "directory was given to write it to")
        path = Path(spill_dir) / "plan.json"
        write_private(path, text)
        return {PLAN_VAR: f"@{path}"}

    @classmethod
    def from_env(cls, environ: typing.Mapping[str, str] | None = None) -> RankPlan:
        env = os.environ if environ is None else environ
        raw = env.get(PLAN_VAR)
        if not raw:
            raise RuntimeError(f"{PLAN_VAR} is not set: this process was not started by prism-launch (run the "
                               "script through prism-launch, or use torchrun for a plain run)")
        text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
        return _build(cls, json.loads(text))


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` readable by this user only (0600 from its creation: never a
    moment readable by others), replacing it atomically."""
    from nccl_ext.core.atomic import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, text)  # 0600 from the temporary file's creation


def _build(tp, value):
    """``value`` (parsed JSON) as type ``tp``: nested plans, tuples, int-keyed dicts, optionals."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(inner[0], value)
    if is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _build(hints[f.name], value[f.name]) for f in fields(tp) if f.name in value})
    if origin is tuple:
        (item, *_rest) = typing.get_args(tp)
        return tuple(_build(item, v) for v in value)
    if origin is dict:
        key, val = typing.get_args(tp)
        return {key(k): _build(val, v) for k, v in value.items()}
    return value
