"""Megatron-core fixes needed when it runs on CPU without TE/Apex.

Used together with :mod:`integrations.cpu_compat`. ``install()`` is
idempotent, imports nothing from Megatron itself and works whether or not
``megatron.core`` is already imported: each fix is applied when its target
module is (or becomes) imported (:func:`integrations.import_hooks.after_import`).
Checked against megatron-core 0.16.1.

Fixes:

* ``megatron.core.transformer.moe.moe_utils``: without Transformer Engine the
  name ``te_general_gemm`` is never bound, yet ``RouterGatingLinearFunction``
  tests ``te_general_gemm is not None`` -> ``NameError`` in every MoE router.
  It is bound to ``None`` so the plain ``torch.mm`` path is taken.
* ``moe_utils.maybe_move_tensor_to_cpu`` (also bound in
  ``moe.token_dispatcher``): it only converts CUDA tensors, so on CPU the
  all-to-all split sizes stay tensors (``as_numpy=True`` callers then hand
  tensors to ``all_to_all_single``). CPU tensors are converted too.
* ``megatron.core.transformer.torch_norm.WrappedTorchNorm`` (the norm the local
  layer spec uses when Apex is missing) rejects ``sequence_parallel``. It is
  built as on Apex/TE: the norm is created normally and its parameters are
  tagged ``sequence_parallel=True`` so ``finalize_model_grads`` all-reduces
  their gradients over the tensor-parallel group.
* ``megatron.core.tensor_parallel.random``: with CUDA RNG calls mapped onto the
  CPU generator, ``CudaRNGStatesTracker.fork`` logs
  "CPU RNG state changed within GPU RNG context" on every fork; that expected
  message is filtered from the module's logger.
* ``megatron.core.parallel_state``: group creation in a large logical world (not a CPU fix, but
  this module is active only where ``device=cpu``). ``generate_masked_orthogonal_rank_groups``
  decomposes every rank of every group in Python (0.5 s a call, 17 calls, in a 65,536-rank
  world); it is replaced by the same lists built from offsets (identical output, checked
  against the original in ``tests/integrations/test_megatron_groups.py``), with the original
  where the world is not the product of the parallel sizes (it asserts there).
  ``create_group`` parses ``"2.4.0"`` with ``packaging`` on every ``new_group`` call
  (``is_torch_min_version``) and asks ``torch.distributed.get_rank()`` (1.6 us) whether to keep
  the group in ``_global_process_group_list``; with torch >= 2.4 it is replaced by the same
  steps with the version check gone and the rank read once per default group.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import threading

from integrations.import_hooks import after_import

__all__ = ["install", "is_installed"]

_LOCK = threading.RLock()
_INSTALLED = False


# --------------------------------------------------------------------------- fixes


def _fix_te_general_gemm(moe_utils):
    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None


def _cpu_aware_move_to_cpu(original):
    import torch

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__wrapped__ = original
    maybe_move_tensor_to_cpu.__doc__ = original.__doc__
    return maybe_move_tensor_to_cpu


def _fix_move_to_cpu(moe_utils):
    original = moe_utils.maybe_move_tensor_to_cpu
    if hasattr(original, "__wrapped__"):
        return
    patched = _cpu_aware_move_to_cpu(original)
    moe_utils.maybe_move_tensor_to_cpu = patched
    # token_dispatcher binds the name at import time.
    dispatcher = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
    if dispatcher is not None and getattr(dispatcher, "maybe_move_tensor_to_cpu", None) is original:
        dispatcher.maybe_move_tensor_to_cpu = patched


def _fix_dispatcher_binding(token_dispatcher):
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is None:
        return
    current = getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None)
    if current is not None and not hasattr(current, "__wrapped__"):
        token_dispatcher.maybe_move_tensor_to_cpu = moe_utils.maybe_move_tensor_to_cpu


def _fix_torch_norm(torch_norm):
    cls = torch_norm.WrappedTorchNorm
    original_new = cls.__dict__["__new__"]
    original_new = getattr(original_new, "__func__", original_new)
    if getattr(original_new, "_sequence_parallel_aware", False):
        return

    def __new__(klass, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original_new(klass, config, hidden_size, *args, **kwargs)
        local_config = copy.copy(config)
        local_config.sequence_parallel = False
        norm = original_new(klass, local_config, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", True)
        return norm

    __new__._sequence_parallel_aware = True
    cls.__new__ = staticmethod(__new__)


class _DropForkRngWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _fix_rng_warning(random_module):
    logger = logging.getLogger(random_module.__name__)
    if not any(isinstance(f, _DropForkRngWarning) for f in logger.filters):
        logger.addFilter(_DropForkRngWarning())


def _offsets(dims) -> list[int]:
    """Every ``sum(i_k * stride_k)`` over ``dims`` = ``[(size_k, stride_k)]``, first dim fastest."""
    out = [0]
    for size, stride in dims:
        out = [o + i * stride for i in range(size) for o in out]
    return out


def _rank_groups_from_offsets(original):
    def generate_masked_orthogonal_rank_groups(world_size, parallel_size, mask):
        strides = [1]
        for size in parallel_size:
            strides.append(strides[-1] * size)
        if strides[-1] != world_size or len(mask) != len(parallel_size):
            return original(world_size, parallel_size, mask)
        dims = list(zip(parallel_size, strides))
        inside = _offsets([d for d, m in zip(dims, mask) if m])  # rank in group -> offset
        bases = _offsets([d for d, m in zip(dims, mask) if not m])  # group index -> first rank
        return [[base + o for o in inside] for base in bases]

    generate_masked_orthogonal_rank_groups.__wrapped__ = original
    generate_masked_orthogonal_rank_groups.__doc__ = original.__doc__
    return generate_masked_orthogonal_rank_groups


def _create_group_with_rank_once(parallel_state, original):
    """megatron-core 0.16.1's ``create_group`` on torch >= 2.4, the caller's rank read once per
    default group instead of once per call."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    known: list = [None, None]  # the default group, the caller's rank in it

    def create_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                     group_desc=None):
        group = dist.new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                               use_local_synchronization=use_local_synchronization, group_desc=group_desc)
        if parallel_state._global_process_group_list is None:
            parallel_state._global_process_group_list = [None]  # None stands for the default group
        if known[0] is not c10d.GroupMember.WORLD:
            known[:] = [c10d.GroupMember.WORLD, dist.get_rank()]
        if known[1] in ranks:
            parallel_state._global_process_group_list.append(group)
        return group

    create_group.__wrapped__ = original
    create_group.__doc__ = original.__doc__
    return create_group


def _fix_group_creation(parallel_state):
    original = parallel_state.generate_masked_orthogonal_rank_groups
    if not hasattr(original, "__wrapped__"):
        parallel_state.generate_masked_orthogonal_rank_groups = _rank_groups_from_offsets(original)
    check = getattr(parallel_state, "is_torch_min_version", None)
    if check is not None and not hasattr(check, "cache_info"):
        parallel_state.is_torch_min_version = check = functools.cache(check)
    create = getattr(parallel_state, "create_group", None)
    if (create is not None and not hasattr(create, "__wrapped__") and check is not None and check("2.4.0")
            and hasattr(parallel_state, "_global_process_group_list")):
        parallel_state.create_group = _create_group_with_rank_once(parallel_state, create)


# --------------------------------------------------------------------------- public API


def is_installed() -> bool:
    return _INSTALLED


def install() -> None:
    """Apply the fixes now for imported modules, on import for the others."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
        after_import("megatron.core.transformer.moe.moe_utils", _fix_te_general_gemm)
        after_import("megatron.core.transformer.moe.moe_utils", _fix_move_to_cpu)
        after_import("megatron.core.transformer.moe.token_dispatcher", _fix_dispatcher_binding)
        after_import("megatron.core.transformer.torch_norm", _fix_torch_norm)
        after_import("megatron.core.tensor_parallel.random", _fix_rng_warning)
        after_import("megatron.core.parallel_state", _fix_group_creation)
