"""Run unchanged DeepSpeed jobs in a prism-launch world (capture, emulation, and ``mode=real``).

``install()`` is cheap and imports nothing from DeepSpeed: it arranges for the patches below
to be applied when the script imports the DeepSpeed modules concerned (or at once, for
modules already imported, e.g. warmed by ``capture.warm_imports``), through
:func:`integrations.import_hooks.after_import`. A script that never
imports DeepSpeed is untouched. Activate it with
``compat.integrations=[deepspeed]`` (DeepSpeed's CPU accelerator needs no
other compatibility module), or append it to the Megatron ones; ``prism-launch`` adds it
by itself when the script passes ``--deepspeed_config`` (see the README).

* **Accelerator.** ``DS_ACCELERATOR`` is left to the user; unset, DeepSpeed detects its CPU
  accelerator on a machine without CUDA (and the CUDA one on a GPU machine).
* **CUDA devices.** DeepSpeed names its GPU by ``LOCAL_RANK`` through its accelerator
  (``get_accelerator().set_device(local_rank)``, ``device_name(local_rank)`` for the engine's
  ``module.to(...)``, ZeRO-3's ``local_device`` and consistency checks, the pipeline module's
  ``self.to(...)``, ``device(local_rank)`` for ``init_process_group``'s ``device_id``). In a
  capture or emulation on CUDA the rank runs on the physical GPU of its device slot
  (``RankPlan.device_slot`` modulo the GPUs present, the rule
  ``prism_launch/launch/devices.py`` applies to ``torch.cuda``): ``CUDA_Accelerator``'s
  ``device_name(i)``, ``device(i)`` and ``set_device(i)`` name that GPU for every ``i``
  (``current_device_name()`` already does, through the redirected ``torch.cuda.set_device``).
  In ``mode=real`` and on CPU nothing is mapped.
* **No op builds.** A config that needs a compiled DeepSpeed op this installation lacks
  (FusedAdam for ``"Adam"`` on CUDA, DeepSpeedCPUAdam for ZeRO-Offload, …) would make every
  rank JIT-compile it (minutes, a compiler and ninja needed on the machine). ``OpBuilder.jit_load``
  raises a :class:`DeepSpeedOpNotBuilt` instead, naming the op and the config change that avoids it
  (``"torch_adam": true``); prebuilt ops (``DS_BUILD_<OP>=1``) load as before.
* **Shared-memory communication op.** DeepSpeed's ``TorchBackend`` JIT-compiles a
  shared-memory all-reduce (``deepspeed_shm_comm``, 25–45 s the first time on 2 cores, then
  cached in ``~/.cache/torch_extensions``) and, when ``LOCAL_SIZE`` equals the world size,
  opens shared memory with every local peer. Training never uses it (only
  ``inference_all_reduce``, which falls back to ``torch.distributed.all_reduce`` without
  it), and in emulation the peers are virtual, so ``build_shm_op`` returns None: every
  collective goes through ``torch.distributed`` and so through the prism process group.
* **Consistency broadcasts from rank 0.** ZeRO-3 checks at the start of every forward that all
  ranks trace the same submodule order: ``assert_lst_len_same_as_other_ranks`` broadcasts rank
  0's list length, then ``get_lst_from_rank0`` rank 0's list. DeepSpeed fills the buffer with
  ``-1`` on every other rank (broadcast overwrites it). In a folded capture without rank 0, a
  broadcast whose root is not captured takes the root's stand-in's buffer — a captured rank's
  ``-1`` — and the check failed ("disagreement on list length between rank0 and rank1000").
  Here every rank fills the buffer with its own length and list (the same op, shapes and
  bytes; a broadcast's result never depends on a non-root's buffer), so the stand-in serves
  what rank 0 would have sent in a consistent job, on CPU and CUDA alike. An empty list is
  not broadcast at all: a zero-byte broadcast from a virtual root is never streamed by the
  assistant (it sends no empty messages), so ``get_lst_from_rank0`` returns ``[]`` without
  communicating (the same result; every mode runs the patched program, so capture,
  emulation and ``mode=real`` issue the same ops).
* **Deterministic ZeRO-3 padding.** ZeRO-3 pads the last partitions of a parameter with
  uninitialised memory (``torch.empty``); those bytes travel in every parameter all-gather.
  ZeRO-3's gradient reduce-scatter (``reduce_scatter_coalesced``) pads each rank's chunk the
  same way, and the pipeline engine sends a tensor-meta buffer whose tail is uninitialised.
  These are zeros here (``torch.empty`` -> ``torch.zeros`` in those two modules), so every
  rank's contributions are deterministic
  and a sandbox's live contributions equal the recorded ones (the values DeepSpeed computes
  are unchanged: padding is never part of a parameter). This matters in large worlds, where a
  rank's partition of a small parameter is all padding.
* **Group descriptions.** DeepSpeed creates its groups with ``new_group(ranks)`` and no
  description; folded capture would then follow every one of them. ``TorchBackend.new_group``
  passes a ``group_desc`` for the groups DeepSpeed builds from its topologies:
  ``DEEPSPEED_DATA_PARALLEL`` (the pipeline grid's ``data`` axis),
  ``DEEPSPEED_EXPERT_DATA_PARALLEL`` (MoE expert data parallel), ``DEEPSPEED_EXPERT_PARALLEL``,
  ``DEEPSPEED_PIPE_PARALLEL`` and ``DEEPSPEED_MODEL_PARALLEL``. The two data-parallel ones
  contain ``DATA_PARALLEL``, so the default ``capture.replicated_groups`` marks them as
  spanning replicas; world-sized groups (pure ZeRO's data-parallel group) always are.
  A pure ZeRO job therefore folds to the sandbox ranks alone; a pipeline job to one
  pipeline (x model-parallel slice); an MoE job to one expert-parallel group.

* **MoE gate counts.** DeepSpeed's token dispatch exchanges a fixed capacity per expert, so a
  forward hook on every ``TopKGate`` sends the gate's own counts (tokens per expert before and
  after the capacity limit) with the dispatch all-to-all that follows, in a capture only
  (:mod:`integrations.deepspeed_gate_counts`; the report's ``moe`` section:
  :mod:`integrations.deepspeed_moe`).

* **Memory.** After a rank's first optimizer step its log gets one line,
  ``prism-launch: deepspeed memory rank R {json}`` (:func:`memory_breakdown`): ZeRO-3 partition
  bytes, fp32 partitions, the configured reduce/all-gather/prefetch buckets and the live-parameter
  cap in bytes, live parameter bytes, optimizer state bytes by device (``cpu`` is ZeRO-Offload's
  host memory) and the offload devices. The rank's peak and the OOM verdict at the target's
  limit are the report's, as for every job.

Checked against DeepSpeed 0.19.8 source with torch 2.13 (CPU; CUDA paths with stand-ins for ``torch.cuda``).
"""

from __future__ import annotations

import os
import threading

from integrations.deepspeed_gate_counts import patch_gate
from integrations.import_hooks import after_import, replaces

__all__ = ["install", "is_installed", "group_label", "LABELS", "physical_gpu", "set_physical_gpu",
           "DeepSpeedOpNotBuilt"]

_LOCK = threading.RLock()
_INSTALLED = False
_PHYSICAL: list[int | None] = [None]  # the rank's physical GPU when logical CUDA indices are mapped


class DeepSpeedOpNotBuilt(RuntimeError):
    """A DeepSpeed config needs a compiled op that this DeepSpeed installation does not have."""


def physical_gpu() -> int | None:
    """The physical GPU every CUDA index DeepSpeed names maps to (None: no mapping)."""
    return _PHYSICAL[0]


def set_physical_gpu(index: int | None) -> None:
    """Map DeepSpeed's CUDA indices onto ``index`` (None: leave them as they are)."""
    _PHYSICAL[0] = None if index is None else int(index)


def _plan_physical_gpu() -> int | None:
    """The plan's physical GPU for this rank, when prism-launch started it on CUDA."""
    from prism_launch.config.plan import PLAN_VAR, RankPlan

    if not os.environ.get(PLAN_VAR) or "RANK" not in os.environ:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    plan = RankPlan.from_env()
    if plan.device != "cuda" or plan.mode == "real":
        return None
    # the rule of prism_launch/launch/devices.py: the rank's device slot modulo the GPUs present
    return plan.device_slot(int(os.environ["RANK"])) % torch.cuda.device_count()

LABELS: dict[tuple[int, ...], str] = {}
"""Rank list -> group description, filled as DeepSpeed computes its group layouts."""

_AXIS_DESC = {"data": "DEEPSPEED_DATA_PARALLEL", "pipe": "DEEPSPEED_PIPE_PARALLEL",
              "model": "DEEPSPEED_MODEL_PARALLEL"}


def group_label(ranks) -> str | None:
    """The description for a DeepSpeed group of ``ranks`` (None when unknown)."""
    try:
        return LABELS.get(tuple(int(r) for r in ranks))
    except TypeError:
        return None


def _label(lists, desc: str) -> None:
    for ranks in lists:
        key = tuple(int(r) for r in ranks)
        if len(key) > 1:
            LABELS.setdefault(key, desc)


# --------------------------------------------------------------------------- patches


def _patch_comm_torch(mod) -> None:
    mod.build_shm_op = lambda: None
    import torch.distributed as dist

    @replaces(mod.TorchBackend, "new_group")
    def new_group(original, self, ranks):
        desc = group_label(ranks)
        if desc is None:
            return dist.new_group(ranks)
        return dist.new_group(ranks, group_desc=desc)


def _patch_topology(mod) -> None:
    @replaces(mod.ProcessTopology, "get_axis_comm_lists")
    def get_axis_comm_lists(original, self, axis):
        lists = original(self, axis)
        desc = _AXIS_DESC.get(axis)
        if desc is not None:
            _label(lists, desc)
        return lists


def _expert_layout(groups, world: int, ep: int, mp: int, pp: int, data_before_expert: bool) -> None:
    """Label the expert-parallel and expert-data-parallel rank lists DeepSpeed is about to
    create (its own layout function; unknown layouts stay unlabelled, which only makes a
    folded capture larger)."""
    try:
        ep_lists, edp_lists = groups._get_expert_parallel_ranks(
            world, mp, ep, pipeline_parallel_size_=pp, use_data_before_expert_parallel_=data_before_expert)
    except Exception:  # noqa: BLE001 - a layout this version does not compute the same way
        return
    _label(edp_lists, "DEEPSPEED_EXPERT_DATA_PARALLEL")
    _label(ep_lists, "DEEPSPEED_EXPERT_PARALLEL")


def _patch_groups(mod) -> None:
    @replaces(mod, "_create_expert_and_data_parallel")
    def _create_expert_and_data_parallel(original, expert_parallel_size_, mp_size=None, pp_size=None, mp_mode="tp",
                                         use_data_before_expert_parallel_=False, folding_spec=None, **kwargs):
        try:
            import deepspeed.comm as dist

            world = dist.get_world_size()
            mp = 1 if mp_size is None else int(mp_size)
            if pp_size is not None:
                pp = int(pp_size)
            else:
                mpu = getattr(mod, "mpu", None)
                pp = 1 if mpu is None else int(mod.bwc_pipeline_parallel_world_size(mpu))
            if mp <= 1 or (mp_mode == "tp" and folding_spec is None):
                _expert_layout(mod, world, int(expert_parallel_size_), mp, pp, use_data_before_expert_parallel_)
        except Exception:  # noqa: BLE001 - labelling is best effort; DeepSpeed's own checks run next
            pass
        return original(expert_parallel_size_, mp_size=mp_size, pp_size=pp_size, mp_mode=mp_mode,
                        use_data_before_expert_parallel_=use_data_before_expert_parallel_,
                        folding_spec=folding_spec, **kwargs)

    @replaces(mod, "_create_expert_data_and_model_parallel")  # (absent from older releases: left alone)
    def _create_expert_data_and_model_parallel(original_mp, expert_parallel_size_, mpu,
                                               use_data_before_expert_parallel_=False, **kwargs):
        try:
            import deepspeed.comm as dist

            world = dist.get_world_size()
            mp = int(mpu.get_tensor_model_parallel_world_size()) if hasattr(
                mpu, "get_tensor_model_parallel_world_size") else int(mpu.get_model_parallel_world_size())
            pp = int(mod.bwc_pipeline_parallel_world_size(mpu))
            _expert_layout(mod, world, int(expert_parallel_size_), mp, pp, use_data_before_expert_parallel_)
        except Exception:  # noqa: BLE001
            pass
        return original_mp(expert_parallel_size_, mpu,
                           use_data_before_expert_parallel_=use_data_before_expert_parallel_, **kwargs)


def _patch_accelerator(mod) -> None:
    acc = mod.CUDA_Accelerator

    @replaces(acc, "device_name")
    def device_name(real, self, device_index=None):
        gpu = _PHYSICAL[0]
        if device_index is None or gpu is None:
            return real(self, device_index)
        return real(self, gpu)

    @replaces(acc, "device")
    def device(real, self, device_index=None):
        gpu = _PHYSICAL[0]
        return real(self, device_index if device_index is None or gpu is None else gpu)

    @replaces(acc, "set_device")
    def set_device(real, self, device_index):
        gpu = _PHYSICAL[0]
        return real(self, device_index if gpu is None else gpu)


_OP_HINTS = {
    "fused_adam": 'the optimizer "Adam"/"AdamW" is FusedAdam on CUDA: add "torch_adam": true to optimizer.params',
    "cpu_adam": 'ZeRO-Offload\'s optimizer ("offload_optimizer") is DeepSpeedCPUAdam: add "torch_adam": true to '
                'optimizer.params and "zero_force_ds_cpu_optimizer": false to the config (torch\'s Adam on the '
                'offloaded CPU state)',
    "cpu_adagrad": 'ZeRO-Offload with "Adagrad" is DeepSpeedCPUAdagrad: choose "Adam" with "torch_adam": true',
    "cpu_lion": 'ZeRO-Offload with "Lion" is DeepSpeedCPULion: choose "Adam" with "torch_adam": true',
    "fused_lamb": 'the optimizer "Lamb" is FusedLamb: choose "Adam"/"AdamW" with "torch_adam": true',
    "fused_lion": 'the optimizer "Lion" is FusedLion on CUDA: choose "Adam"/"AdamW" with "torch_adam": true',
}


def op_not_built_message(name: str) -> str:
    """Why an op build is refused, and what to change."""
    hint = _OP_HINTS.get(name, "change the config so that it does not need it")
    return (f"DeepSpeed op {name!r} is not built into this DeepSpeed installation, and prism-launch does not "
            f"JIT-compile DeepSpeed ops (every rank of the job would compile it). Either {hint}, or install "
            f"DeepSpeed with the op prebuilt (DS_BUILD_{name.upper()}=1 pip install deepspeed).")


def _patch_op_builder(mod) -> None:
    @replaces(mod.OpBuilder, "jit_load")
    def jit_load(original, self, verbose=True):
        raise DeepSpeedOpNotBuilt(op_not_built_message(str(getattr(self, "name", type(self).__name__))))


def _patch_zero_utils(mod) -> None:
    torch, dist = mod.torch, mod.dist

    def _local_device():
        return torch.device(mod.get_accelerator().device_name(os.environ["LOCAL_RANK"]))

    @replaces(mod, "assert_lst_len_same_as_other_ranks")
    def assert_lst_len_same_as_other_ranks(original, lst):
        # every rank's own length in the buffer (DeepSpeed: -1 off rank 0): a stand-in for an
        # uncaptured rank 0 then broadcasts what rank 0 holds in a consistent job
        rank0_len_tensor = torch.tensor(len(lst), dtype=int, device=_local_device(), requires_grad=False)
        dist.broadcast(rank0_len_tensor, src=0, async_op=False)
        rank0_list_length = rank0_len_tensor.cpu().item()
        if rank0_list_length != len(lst):
            raise RuntimeError(f"Detected a disagreement on list length between rank0 and rank{dist.get_rank()}: "
                               f"\n rank0: {rank0_list_length} "
                               f"\n rank{dist.get_rank()}: {len(lst)}")

    @replaces(mod, "get_lst_from_rank0")
    def get_lst_from_rank0(original, lst):
        if len(lst) == 0:  # every rank checked the length first: nothing to broadcast
            return []
        lst_tensor = torch.tensor(list(lst), dtype=int, device=_local_device(), requires_grad=False)
        dist.broadcast(lst_tensor, src=0, async_op=False)
        return [t.item() for t in lst_tensor.cpu()]


def _patch_partition_parameters(mod) -> None:
    @replaces(mod.Init, "_partition_param")
    def _partition_param(original, self, param, *args, **kwargs):
        out = original(self, param, *args, **kwargs)
        part = getattr(param, "ds_tensor", None)
        if part is not None and part.numel() and getattr(param, "ds_numel", None) is not None:
            start = part.numel() * self._partition_rank(param)
            valid = min(max(param.ds_numel - start, 0), part.numel())
            if valid < part.numel():
                with mod.torch.no_grad():
                    part.narrow(0, valid, part.numel() - valid).zero_()
        return out


class _ZeroPaddingTorch:
    """``torch`` as ``deepspeed.runtime.comm.coalesced_collectives`` and the pipeline engine
    see it: ``empty`` (reduce-scatter padding, the tensor-meta and p2p buffers) allocates zeros."""

    def __init__(self, torch):
        self._torch = torch
        self.empty = torch.zeros

    def __getattr__(self, name):
        return getattr(self._torch, name)


def _patch_coalesced_collectives(mod) -> None:
    if isinstance(mod.torch, _ZeroPaddingTorch):
        return
    mod.torch = _ZeroPaddingTorch(mod.torch)


def _nbytes(t) -> int:
    try:
        return int(t.numel()) * int(t.element_size())
    except Exception:  # noqa: BLE001 - not a tensor
        return 0


def memory_breakdown(engine) -> dict:
    """What a DeepSpeed user asks of memory, from the engine's own objects (no communication, no
    allocation): ZeRO partitions, the configured buckets in bytes, live parameters, optimizer
    state by device (ZeRO-Offload's is host memory)."""
    def call(name, default=None):
        value = getattr(engine, name, default)
        return value() if callable(value) else value

    out: dict = {"zero_stage": call("zero_optimization_stage", 0),
                 "dp_world_size": getattr(engine, "dp_world_size", None)}
    params = list(engine.module.parameters())
    elem = params[0].element_size() if params else 4
    out["param_count"] = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    out["live_param_bytes"] = sum(_nbytes(p.data) for p in params)
    parts = [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
    if parts:
        out["zero3_partition_bytes"] = sum(_nbytes(t) for t in parts)
    opt = getattr(engine, "optimizer", None)
    fp32 = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", None)
    if fp32:
        out["fp32_partition_bytes"] = sum(_nbytes(t) for t in fp32)
    comm = call("communication_data_type")
    comm_elem = getattr(comm, "itemsize", elem) if comm is not None else elem
    buckets = {}
    for key, name in (("reduce_bucket", "zero_reduce_bucket_size"), ("allgather_bucket", "zero_allgather_bucket_size"),
                      ("stage3_prefetch_bucket", "zero_prefetch_bucket_size"),
                      ("stage3_max_live_parameters", "zero_max_live_parameters")):
        n = call(name)
        stages = (3,) if key.startswith("stage3") else (1, 2) if key == "allgather_bucket" else (1, 2, 3)
        if n is not None and out["zero_stage"] in stages:
            buckets[key] = {"elements": int(n), "bytes": int(n) * int(comm_elem if "bucket" in key else elem)}
    out["buckets"] = buckets
    state: dict = {}
    basic = getattr(engine, "basic_optimizer", None)
    for per_param in (getattr(basic, "state", {}) or {}).values():
        for v in per_param.values():
            if hasattr(v, "device"):
                state[v.device.type] = state.get(v.device.type, 0) + _nbytes(v)
    out["optimizer_state_bytes"] = state
    off_opt, off_param = call("zero_offload_optimizer"), call("zero_offload_param")
    out["offload"] = {"optimizer": str(getattr(off_opt, "device", None) or "none"),
                      "param": str(getattr(off_param, "device", None) or "none")}
    return out


def _report_after_first_step(engine) -> None:
    """Print the rank's :func:`memory_breakdown` once, after its first optimizer step (when the
    optimizer state exists), as one line of its log: ``prism-launch: deepspeed memory {json}``."""
    basic = getattr(engine, "basic_optimizer", None)
    if basic is None or not hasattr(basic, "register_step_post_hook"):
        return
    handle = []

    def hook(*_):
        handle.pop().remove()
        import json

        try:
            detail = json.loads(json.dumps(memory_breakdown(engine), default=str))
        except Exception as e:  # noqa: BLE001 - a report, never a failure of the job
            detail = {"error": repr(e)}
        from prism_launch.rank.memory import add_detail

        add_detail("deepspeed", detail)  # into the rank's summary, hence report.json
        print(f"prism-launch: deepspeed memory rank {os.environ.get('RANK', '?')} {json.dumps(detail)}", flush=True)

    handle.append(basic.register_step_post_hook(hook))


def _patch_deepspeed(mod) -> None:
    @replaces(mod, "initialize")
    def initialize(original, *args, **kwargs):
        out = original(*args, **kwargs)
        try:
            _report_after_first_step(out[0])
        except Exception:  # noqa: BLE001
            pass
        return out


_PATCHES = {
    "deepspeed": _patch_deepspeed,
    "deepspeed.accelerator.cuda_accelerator": _patch_accelerator,
    "deepspeed.ops.op_builder.builder": _patch_op_builder,
    "op_builder.builder": _patch_op_builder,  # DeepSpeed installed from a source tree
    "deepspeed.comm.torch": _patch_comm_torch,
    "deepspeed.runtime.comm.coalesced_collectives": _patch_coalesced_collectives,
    "deepspeed.runtime.pipe.engine": _patch_coalesced_collectives,
    "deepspeed.runtime.zero.partition_parameters": _patch_partition_parameters,
    "deepspeed.runtime.zero.utils": _patch_zero_utils,
    "deepspeed.runtime.pipe.topology": _patch_topology,
    "deepspeed.utils.groups": _patch_groups,
    "deepspeed.moe.sharded_moe": patch_gate,
}


EXPLICIT_CUDA_INDICES = True
"""DeepSpeed recipes name their GPU as ``cuda:LOCAL_RANK`` in torch calls (``module.to(...)``,
``torch.device("cuda", local_rank)``): on CUDA the rank's bootstrap maps such indices onto the
physical GPU with a TorchFunctionMode (``prism_launch/launch/devices.py``). Megatron-style
code selects its GPU with ``torch.cuda.set_device`` and pays nothing for it."""


def install() -> None:
    """Patch DeepSpeed's modules now (those already imported) or as they are imported."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
        if _PHYSICAL[0] is None:
            set_physical_gpu(_plan_physical_gpu())
        for name, patch in _PATCHES.items():
            after_import(name, patch)


def is_installed() -> bool:
    return _INSTALLED
