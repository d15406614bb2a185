"""Capture: where the trace goes, how logical ranks share the devices while it is recorded, folding."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from prism_launch.config.errors import ConfigError

@dataclass(kw_only=True, slots=True)
class TraceConfig:
    dir: str | None = None
    """Trace directory. Default: ``prism_traces/<script>-<fingerprint>`` under the working directory."""
    ignore_args: list[str] = field(default_factory=list)
    """The recipe's own output-only flags (``--out``): their values do not key the trace, like
    the integrations' (Megatron-LM's ``--save``, ``--tensorboard-dir``, ``--wandb-*``; DeepSpeed
    recipes' ``--output_dir``, ``--logging_dir``, ``--run_name`` …). Their presence still counts."""
    trusted: bool = False
    """Replay a trace you did not sign (another user's, or one edited since) as if you had: its
    object-collective payloads (pickles, which run code when loaded) are then unpickled without
    the allow-list emulation otherwise puts them through. Only for a trace whose author you trust."""

    def validate(self) -> None:
        bad = [a for a in self.ignore_args if not a.startswith("-") or "=" in a]
        if bad:
            raise ConfigError(f"trace.ignore_args names flags, e.g. trace.ignore_args=[--out] (got {bad})")


class Park(StrEnum):
    auto = "auto"
    """``cuda_checkpoint`` on CUDA when ``capture.resident`` is set, else ``none``."""
    none = "none"
    """Parked ranks keep their state where it is (host memory on CPU)."""
    cuda_checkpoint = "cuda_checkpoint"
    """Parked ranks' GPU memory moves to host memory through the CUDA driver's checkpoint API
    (``cuCheckpointProcess*``) and back before they resume."""


class Payload(StrEnum):
    auto = "auto"
    """Under ``mode=auto`` without calibration (the trace's only reader is this run's emulation of
    its sandbox ranks): ``exact``. Otherwise (``mode=capture``, whose trace later runs may emulate
    with other sandbox ranks or calibrate; ``calibrate.in_auto``): ``full``, then ``exact``. Each
    while the trace stays within ``capture.payload_budget_gib`` and the free space where it is
    written; a capture that would pass it stops and records again with the next policy, ``none``
    last (the run says so and why)."""
    exact = "exact"
    """Exact for the sandbox ranks named at capture (``sandbox.ranks``, recorded in the manifest as
    ``payload_ranks``): the trace stores only the tensors they consume — their virtual peers'
    contributions to the groups they share, sends to them, the folded results they receive — and
    of their own contributions and sends a digest and small statistics (word sum, L1 norm,
    max-abs) for the divergence checks; nothing of groups no sandbox rank belongs to. Sandbox
    outputs bit-identical to the capture. Emulating other sandbox ranks (or calibrating) is
    refused (``mode=auto`` captures again)."""
    full = "full"
    """Every captured rank's contributions, sends and folded results: any sandbox set within the
    captured ranks can be emulated exactly, and calibration can run every captured rank."""
    none = "none"
    """No tensor payloads: the trace holds the op sequence, groups, shapes, dtypes, bytes,
    timings, memory and MoE routing counts. Every collective's result is synthesized on the
    rank's own device, in capture and emulation alike, as if each other member contributed what
    this rank contributes (``nccl_ext/core/synth.py``); broadcasts up to ``capture.carry_bytes``
    keep their real payload (they carry control flow: flags, batch metadata). Nothing but
    metadata reaches the launcher; ranks never wait on each other, so captured ranks run at
    the job's speed, ``capture.slots`` at a time (admitted by memory)."""


@dataclass(kw_only=True, slots=True)
class CaptureConfig:
    warm_imports: list[str] = field(default_factory=lambda: ["torch", "megatron.core"])
    """Modules imported once in the launcher before ranks are forked (missing ones are skipped)."""
    slots: int | None = None
    """Logical ranks that run at once; the others are parked (blocked on communication) or
    waiting for a slot. Default: the number of CPU cores (each running rank needs one to drive
    its device); on CUDA ranks are also admitted to their first slot by the GPUs' free memory.
    0: no limit."""
    park: Park = Park.auto
    """What parking does with a blocked rank's device state."""
    resident: int | None = None
    """With ``park=cuda_checkpoint``: ranks whose GPU state may stay on the device at once
    (running + parked); more parked ranks are checkpointed to host memory. Default: ``slots``."""
    fold: bool | None = None
    """Symmetry-folded capture: capture only the ranks closed under the sandbox ranks'
    model-parallel groups and derive data-parallel replicas from them. Default (None):
    fold when the world has more than ``fold_threshold`` ranks."""
    fold_threshold: int = 64
    """World size above which ``fold`` (when unset) turns on."""
    payload: Payload = Payload.auto
    """What the trace records of the tensors ranks exchange (see :class:`Payload`)."""
    payload_budget_gib: float = 32.0
    """``payload=auto``: the most tensor data a ``full`` or ``exact`` trace may hold before the
    capture records again with the next policy (``capture.payload=auto``'s order); also capped by the
    free space at the trace directory, less 10%."""
    exchange: bool = True
    """``payload=exact``/``full``: a collective on a group of at most 8 members, all captured, passes
    through shared memory (``/dev/shm``): each member stages its contribution there and computes its
    own result from its peers' (the same fold, in group-rank order); the coordinator gets where they
    lie and reads only what the trace records. Sends between captured ranks, and contributions of
    64 KiB or more to collectives the coordinator computes (and their results), pass there too.
    ``false``: every contribution goes to the coordinator and back."""
    gpu_exchange_mib: int = 512
    """``exchange`` on CUDA: each captured rank's buffer on its GPU (outside its memory figures)
    where its contributions and sends stay: its peers read them there by CUDA IPC, ordered by
    interprocess events, so no CPU waits for the GPU at a collective and the program runs ahead
    of its kernels as over NCCL. What the trace reads on the host (a sandbox rank's digests, the
    contributions it consumes) is also copied to the host arena, asynchronously. A contribution
    that does not fit goes through the host arena. 0: every contribution through the host arena."""
    spill_mib: float = 64.0
    """``payload=exact``/``full``: distinct tensors the launcher holds before writing them into the
    trace's next spill file in its staging directory (its memory for tensors, whatever the number
    of steps). Identical tensors are stored once."""
    carry_bytes: int = 64 * 1024
    """``payload=none``: broadcasts and scatters up to this size keep their real payload."""
    gpu_waits: bool | None = None
    """On CUDA, with the GPU exchange: a wait on a collective that the exchange computes returns
    at once, the program's stream waiting for the op on the GPU (CUDA stream memory operations),
    as over NCCL, once no captured rank is parked, from the program's third step on (no wait is
    deferred in its first two steps); false: the rank blocks until its peers have arrived. With
    them the captured ranks' CUDA contexts get 32 hardware queues and load every kernel up front
    (the program's ``os.environ`` keeps its own ``CUDA_DEVICE_MAX_CONNECTIONS`` and
    ``CUDA_MODULE_LOADING``), and no host memory is unlocked once waits may be deferred. A
    failure of such an op is raised by the rank's next op; a deferred op whose results are not
    written within 60 s of its wait (or by ``comm.timeout_s``) fails by name, the rank tells the
    coordinator, and no wait is deferred after it.

    Unset (default): on where an integration vouches for the recipe and none speaks against it
    (Megatron-LM recipes, ``--num-layers``, without ``--num-experts``); the launcher prints its
    choice and why, and where a rank's waits then stop it captures once more without them,
    saying so. A program that copies to pageable host memory right behind such a wait stops
    there (the copy holds the CUDA driver's lock that the wait's fold needs): Megatron's MoE
    token dispatchers did; a capture makes their copies (and its own reads) into pinned memory,
    but until that is measured MoE recipes capture without unless this is set to true. Measured
    speeds: docs/benchmarks.md."""
    fold_exchange: bool = True
    """Folded ``exact``/``full`` captures with ``exchange``: a SUM/AVG all-reduce or reduce-scatter on
    a folded group of more than 64 members with 2 to 8 captured ones (a data-parallel gradient
    reduction with several model shards captured) is summed by each captured member from the
    others' staged contributions — on its GPU with the GPU exchange — with the coordinator's
    arithmetic; a member whose result the trace keeps (a sandbox rank's) stages it for the
    coordinator. ``false``: the coordinator sums it on the host and the members wait for it."""
    switch_interval_us: int = 200
    """Python's thread switch interval (``sys.setswitchinterval``) in the launcher and the captured
    ranks while they capture. Each op's completion hops between threads (a rank's program and the
    thread that receives its results, the coordinator and its helpers): at Python's default of
    5,000 us a hop can wait that long for a busy thread to let go. 0: Python's default."""
    replicated_groups: list[str] = field(default_factory=lambda: [
        "DATA_PARALLEL", "HYBRID_DP", "DISTRIBUTED_OPTIMIZER_INSTANCE", "default_pg",
        "mesh_dp_", "mesh_fsdp", "mesh_efsdp", "mesh_batch", "mesh_loss"])
    """Substrings of group descriptions (``group_desc``) that mark groups spanning
    data-parallel replicas; folding never follows them. Groups without a description are
    treated as model-parallel (followed), which only makes the captured set larger.
    Megatron-core names its data-parallel groups ``DATA_PARALLEL…``/``HYBRID_DP…``/
    ``DISTRIBUTED_OPTIMIZER_INSTANCE…``; a ``DeviceMesh`` (torchtitan) names each dimension's
    group ``mesh_<dim>``, the data-parallel ones being ``dp_replicate``, ``dp_shard`` and the
    flattened ``dp_shard_cp``, ``fsdp``, ``efsdp``, ``batch`` and ``loss``."""
    ep_sample: int | None = 4
    """Folded captures of MoE jobs: how many ranks of each expert-parallel group to capture (the
    sandbox ranks' EP ranks first, then ranks spread evenly over the group), instead of the whole
    group (EP16·PP2 at 1,024 ranks: 8 captured ranks, not 32). An uncaptured EP rank mirrors a
    captured one's shard (same shapes); at an all-gather of token counts on the EP group it routes
    as the captured routers did at that op (their tokens per expert, apportioned over its own
    token count: hot experts stay hot), and its all-to-all pieces to captured ranks have the sizes
    those counts give, their data a captured rank's rows (synthesized; pieces between captured
    ranks are exact). Expert-parallel groups are those whose description names them
    (``prism_launch.capture.fold.EP_GROUPS``). null or 0: capture whole EP groups."""

    tp_sample: int | None = 2
    """Folded captures with ``payload=none``: how many ranks of each tensor-parallel group to capture:
    TP position 0 (where megatron-core loads the batch and broadcasts it), the sandbox ranks' own
    positions, then positions spread evenly (TP8·PP4 at 8,192 ranks: 8 captured ranks, not 32). A rank
    at another position mirrors the captured one nearest to it other than position 0: the same stage,
    the same shapes (megatron-core pads the vocabulary so that every TP shard is alike). Without
    payloads every collective's result is synthesized, so nothing a captured rank computes depends on
    which peers ran; with payloads the TP groups are captured whole whatever this says.
    Tensor-parallel groups are those whose description ends with a name in
    ``prism_launch.capture.fold.TP_GROUPS``. null or 0: capture whole TP groups."""

    def validate(self) -> None:
        if self.tp_sample is not None and self.tp_sample < 0:
            raise ConfigError(f"capture.tp_sample must be >= 0 (got {self.tp_sample}; 0 or null captures whole "
                              "tensor-parallel groups)")
        if self.ep_sample is not None and self.ep_sample < 0:
            raise ConfigError(f"capture.ep_sample must be >= 0 (got {self.ep_sample}; 0 or null captures whole "
                              "expert-parallel groups)")
        if self.slots is not None and self.slots < 0:
            raise ConfigError(f"capture.slots must be >= 0 (got {self.slots}; 0 means no limit)")
        if self.payload_budget_gib <= 0:
            raise ConfigError(f"capture.payload_budget_gib must be > 0 (got {self.payload_budget_gib})")
        if self.spill_mib <= 0:
            raise ConfigError(f"capture.spill_mib must be > 0 (got {self.spill_mib})")
        if self.carry_bytes < 0:
            raise ConfigError(f"capture.carry_bytes must be >= 0 (got {self.carry_bytes})")
        if self.gpu_exchange_mib < 0:
            raise ConfigError(f"capture.gpu_exchange_mib must be >= 0 (got {self.gpu_exchange_mib}; 0: off)")
        if self.switch_interval_us < 0:
            raise ConfigError(f"capture.switch_interval_us must be >= 0 (got {self.switch_interval_us}; 0: Python's default)")
        if self.fold_threshold < 1:
            raise ConfigError(f"capture.fold_threshold must be >= 1 (got {self.fold_threshold})")
