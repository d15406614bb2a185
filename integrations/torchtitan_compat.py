"""Run unchanged torchtitan jobs (``python -m torchtitan.train``) in a prism-launch world.

``install()`` is cheap and imports nothing from torchtitan: its patches apply when the script
imports the modules concerned (:func:`integrations.import_hooks.after_import`). Activate it
with ``compat.integrations=[cpu,torchtitan]``; ``prism-launch`` adds it by itself when the
script's arguments carry torchtitan's flags (``--job.config_file``, ``--model.name``, …).

* **Triton on a CPU-only torch.** ``import torchtitan`` imports
  ``torchtitan.models.moe.kernels``, which imports ``triton`` at module level to define the
  GPU kernel behind MoE token permutation; a CPU torch has no Triton, so the import fails
  before any training code runs. When ``triton`` is not importable, that one module executes
  with a stand-in ``triton`` visible only while its code runs (``triton.jit`` returns a kernel
  that raises :class:`TritonUnavailable` when launched; torch itself never sees the stand-in,
  so its own "is Triton there" checks stay truthful), and its ``generate_permute_indices``
  defaults to torchtitan's own CPU implementation (``use_cpu=True``, the same indices).
* **Context parallelism.** On CPU tensors SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``
  (and its backward), which torch's context parallelism (``_ContextParallel`` with SDPA, as
  torchtitan's ``--parallelism.context_parallel_degree`` applies it) does not dispatch: without
  CUDA, :mod:`integrations.torchtitan_cp` adds both ops to CP's handlers and sharding rules, so
  torch's own ring attention runs them, block by block, with the CPU flash kernel.
* **Devices.** torchtitan's ``tools.utils.device_type`` falls back to ``"cuda"`` on a machine
  without an accelerator, so it builds ``cuda:N`` devices, calls ``torch.cuda.set_device`` and
  asks for a ``cuda`` DeviceMesh; the CPU compatibility layer (``cpu``) maps all of these to
  the host, as for Megatron. It then asks ``init_process_group`` for ``nccl`` (or
  ``cuda:nccl,cpu:gloo``): on a torch built without NCCL every ``nccl`` in the backend string
  becomes ``gloo`` (in capture and emulation the prism group answers whatever is asked; this is
  for ``mode=real``). DTensor's RNG tracker refuses a ``cuda`` mesh when
  ``torch.cuda.is_available()`` is False (which the CPU layer keeps truthful), so DTensor's
  ``is_rng_supported_mesh`` answers False for a ``cuda`` mesh without CUDA: DTensor random ops
  and ``manual_seed`` then behave as on a CPU mesh (the default generator, seeded by
  torchtitan's ``torch.manual_seed``).

* **Pipeline metadata inference.** torch's pipelining runs each later stage's forward once on
  uninitialised tensors to learn its shapes; those are zero-filled, so the tensor-parallel
  collectives of that forward carry the same bytes in a capture and in its emulation.

The patches are active on CPU and CUDA (each is a no-op where it is not needed: Triton and NCCL
present, CUDA available). Checked against torchtitan 0.2.2 with torch 2.13 (CPU).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types

from integrations import torchtitan_cp
from integrations.import_hooks import after_import, replaces

__all__ = ["install", "is_installed", "TritonUnavailable", "KERNELS"]

KERNELS = "torchtitan.models.moe.kernels"
"""The torchtitan module that imports ``triton`` unconditionally."""

_LOCK = threading.RLock()
_INSTALLED = False


class TritonUnavailable(RuntimeError):
    """A torchtitan Triton kernel was launched on a torch without Triton."""


def _unavailable_kernel(fn):
    name = getattr(fn, "__name__", "kernel")

    class _Kernel:
        __name__ = name
        __wrapped__ = fn

        def __getitem__(self, grid):
            raise TritonUnavailable(
                f"torchtitan launched its Triton kernel {name} but Triton is not installed (a CPU-only torch): "
                "on CPU, MoE token permutation uses torchtitan's CPU implementation (use_cpu=True)")

        __call__ = __getitem__

    return _Kernel()


def _stand_in_triton() -> tuple[types.ModuleType, types.ModuleType]:
    """A ``triton`` with ``jit`` and a ``language`` whose attributes are inert placeholders:
    enough to define (not run) the kernels of ``torchtitan.models.moe.kernels``."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.__getattr__ = lambda attr: object  # tl.constexpr and friends, used in annotations
    triton.language = language
    triton.jit = lambda fn=None, **kw: _unavailable_kernel(fn) if fn is not None else _unavailable_kernel
    return triton, language


def triton_available() -> bool:
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None


class _KernelsLoader(importlib.abc.Loader):
    """Executes torchtitan's kernels module with the stand-in ``triton`` in ``sys.modules``
    only for the duration of its code."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        triton, language = _stand_in_triton()
        sys.modules["triton"], sys.modules["triton.language"] = triton, language
        try:
            self._loader.exec_module(module)
            _cpu_permutation(module)  # before torchtitan.models.moe.utils binds the name
        finally:
            for name, stub in (("triton", triton), ("triton.language", language)):
                if sys.modules.get(name) is stub:
                    del sys.modules[name]
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
                module.__spec__.loader = self._loader


class _KernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != KERNELS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _KernelsLoader(spec.loader)
        return spec


def gloo_for_nccl(backend):
    """``backend`` with ``nccl`` replaced by ``gloo`` (``cuda:nccl,cpu:gloo`` -> ``gloo``)."""
    if not isinstance(backend, str) or "nccl" not in backend.lower():
        return backend
    if ":" not in backend:
        return "gloo"
    parts = {p.split(":", 1)[1].strip().lower().replace("nccl", "gloo") for p in backend.split(",")}
    return parts.pop() if len(parts) == 1 else backend.lower().replace("nccl", "gloo")


def _gloo_without_nccl(mod) -> None:
    import torch.distributed as dist

    if dist.is_nccl_available():
        return

    @replaces(dist, "init_process_group")
    def init_process_group(original, backend=None, *args, **kwargs):
        return original(gloo_for_nccl(backend), *args, **kwargs)


def _rng_mesh_without_cuda(mod) -> None:
    import torch

    if torch.cuda.is_available():
        return

    @replaces(mod, "is_rng_supported_mesh")
    def is_rng_supported_mesh(original, device_mesh) -> bool:
        if getattr(device_mesh, "device_type", None) == "cuda":
            return False
        return original(device_mesh)


def _cpu_permutation(mod) -> None:
    @replaces(mod, "generate_permute_indices")
    def generate_permute_indices(original, *args, use_cpu: bool = True, **kwargs):
        return original(*args, use_cpu=use_cpu, **kwargs)


def _zeroed_stage_metadata(mod) -> None:
    """torch.distributed.pipelining's metadata inference (torch 2.13: ``TensorMeta.to_tensor``
    and ``to_dtensor``) runs each later stage's forward on tensors made by
    ``_make_tensor_from_meta``, i.e. ``torch.empty_strided``: uninitialised memory, which that
    forward's tensor-parallel collectives then carry. Zero-filled here, so those bytes are the
    same in a capture and its emulation (and compared bit for bit); the inference's outputs are
    discarded, so training is unchanged. Receive buffers made by the same function (stage.py
    binds it by name after this patch) are zeroed too, once, when a stage allocates them."""

    @replaces(mod, "_make_tensor_from_meta")
    def _make_tensor_from_meta(original, *args, **kwargs):
        return original(*args, **kwargs).zero_()


_FINDER = _KernelsFinder()


def install() -> None:
    """Arrange torchtitan's patches (idempotent); touches nothing until torchtitan is imported."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
        after_import("torchtitan.distributed.utils", _gloo_without_nccl)
        after_import("torch.distributed.tensor.experimental._context_parallel._attention", torchtitan_cp.install)
        for name in ("torch.distributed.tensor._random", "torch.distributed.tensor._dispatch"):
            after_import(name, _rng_mesh_without_cuda)
        after_import("torch.distributed.pipelining._utils", _zeroed_stage_metadata)
        if not triton_available():
            if KERNELS not in sys.modules and _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)


def is_installed() -> bool:
    return _INSTALLED
