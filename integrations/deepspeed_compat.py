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
* **Shared-memory communication op.** DeepSpeed's ``TorchBackend`` JIT-compiles a
  shared-memory all-reduce (``deepspeed_shm_comm``, 25–45 s the first time on 2 cores, then
  cached in ``~/.cache/torch_extensions``) and, when ``LOCAL_SIZE`` equals the world size,
  opens shared memory with every local peer. Training never uses it (only
  ``inference_all_reduce``, which falls back to ``torch.distributed.all_reduce`` without
  it), and in emulation the peers are virtual, so ``build_shm_op`` returns None: every
  collective goes through ``torch.distributed`` and so through the prism process group.
* **Empty consistency broadcast.** ZeRO-3 checks at the start of every forward that all ranks
  trace the same submodule order: after checking the list's length on every rank it broadcasts
  rank 0's list. At the first step the list is empty, and a zero-byte broadcast from a virtual
  root is never streamed by the assistant (it sends no empty messages), so the sandbox would
  wait for it until its deadline. ``get_lst_from_rank0`` returns ``[]`` for an empty list
  without communicating (the same result; every mode runs the patched program, so capture,
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

Checked against DeepSpeed 0.19.8 with torch 2.13 (CPU).
"""

from __future__ import annotations

import threading

from integrations.import_hooks import after_import

__all__ = ["install", "is_installed", "group_label", "LABELS"]

_LOCK = threading.RLock()
_INSTALLED = False

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
    backend = mod.TorchBackend
    if getattr(backend.new_group, "__prism_labelled__", False):
        return
    import torch.distributed as dist

    def new_group(self, ranks):
        desc = group_label(ranks)
        if desc is None:
            return dist.new_group(ranks)
        return dist.new_group(ranks, group_desc=desc)

    new_group.__prism_labelled__ = True
    new_group.__wrapped__ = backend.new_group
    backend.new_group = new_group


def _patch_topology(mod) -> None:
    topo = mod.ProcessTopology
    original = topo.get_axis_comm_lists
    if getattr(original, "__prism_labelled__", False):
        return

    def get_axis_comm_lists(self, axis):
        lists = original(self, axis)
        desc = _AXIS_DESC.get(axis)
        if desc is not None:
            _label(lists, desc)
        return lists

    get_axis_comm_lists.__prism_labelled__ = True
    get_axis_comm_lists.__wrapped__ = original
    topo.get_axis_comm_lists = get_axis_comm_lists


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
    original = mod._create_expert_and_data_parallel
    if getattr(original, "__prism_labelled__", False):
        return

    def _create_expert_and_data_parallel(expert_parallel_size_, mp_size=None, pp_size=None, mp_mode="tp",
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

    _create_expert_and_data_parallel.__prism_labelled__ = True
    _create_expert_and_data_parallel.__wrapped__ = original
    mod._create_expert_and_data_parallel = _create_expert_and_data_parallel

    original_mp = getattr(mod, "_create_expert_data_and_model_parallel", None)
    if original_mp is None:
        return

    def _create_expert_data_and_model_parallel(expert_parallel_size_, mpu, use_data_before_expert_parallel_=False,
                                               **kwargs):
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

    _create_expert_data_and_model_parallel.__prism_labelled__ = True
    _create_expert_data_and_model_parallel.__wrapped__ = original_mp
    mod._create_expert_data_and_model_parallel = _create_expert_data_and_model_parallel


def _patch_zero_utils(mod) -> None:
    original = mod.get_lst_from_rank0
    if getattr(original, "__prism_patched__", False):
        return

    def get_lst_from_rank0(lst):
        if len(lst) == 0:  # every rank checked the length first: nothing to broadcast
            return []
        return original(lst)

    get_lst_from_rank0.__prism_patched__ = True
    get_lst_from_rank0.__wrapped__ = original
    mod.get_lst_from_rank0 = get_lst_from_rank0


def _patch_partition_parameters(mod) -> None:
    init = mod.Init
    original = init._partition_param
    if getattr(original, "__prism_patched__", False):
        return

    def _partition_param(self, param, *args, **kwargs):
        out = original(self, param, *args, **kwargs)
        part = getattr(param, "ds_tensor", None)
        if part is not None and part.numel() and getattr(param, "ds_numel", None) is not None:
            start = part.numel() * self._partition_rank(param)
            valid = min(max(param.ds_numel - start, 0), part.numel())
            if valid < part.numel():
                with mod.torch.no_grad():
                    part.narrow(0, valid, part.numel() - valid).zero_()
        return out

    _partition_param.__prism_patched__ = True
    _partition_param.__wrapped__ = original
    init._partition_param = _partition_param


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


_PATCHES = {
    "deepspeed.comm.torch": _patch_comm_torch,
    "deepspeed.runtime.comm.coalesced_collectives": _patch_coalesced_collectives,
    "deepspeed.runtime.pipe.engine": _patch_coalesced_collectives,
    "deepspeed.runtime.zero.partition_parameters": _patch_partition_parameters,
    "deepspeed.runtime.zero.utils": _patch_zero_utils,
    "deepspeed.runtime.pipe.topology": _patch_topology,
    "deepspeed.utils.groups": _patch_groups,
}


def install() -> None:
    """Patch DeepSpeed's modules now (those already imported) or as they are imported."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
        for name, patch in _PATCHES.items():
            after_import(name, patch)


def is_installed() -> bool:
    return _INSTALLED
