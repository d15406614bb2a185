"""Object-collective payloads of a trace its user did not sign, unpickled through an allow-list.

``broadcast_object_list``, ``all_gather_object``, ``gather_object``, ``scatter_object_list``
and ``recv_object_list`` hand the bytes they receive to ``pickle``; in emulation those bytes
come from the trace, and a pickle can name any callable (``os.system``). torch unpickles them
in ``torch.distributed.distributed_c10d._tensor_to_object`` through the module-level
``_unpickler`` (``pickle.Unpickler``) — checked against torch 2.13 here and an earlier 2.x
copy, both the same, so 2.11 between them too. :func:`install` replaces that name with
:class:`RestrictedUnpickler`, whose ``find_class`` answers only:

* builtins containers, numbers, ``str``/``bytes``, and ``copyreg``'s object reconstruction;
* ``argparse.Namespace``, ``collections.OrderedDict``/``defaultdict``/``deque``, ``datetime``,
  ``pathlib`` paths;
* torch tensors, parameters, dtypes, layouts, memory formats, devices and ``torch.Size``, with
  the functions torch's pickling rebuilds them with; a storage's nested ``torch.save`` bytes are
  loaded with ``torch.load(weights_only=True)`` (torch's own allow-list), never as torch would
  (``weights_only=False``);
* numpy arrays, dtypes and scalars;
* dataclasses and enums of the modules under :data:`ALLOWED_PREFIXES` (the frameworks' own
  plans and settings, and ``torch.distributed.checkpoint``'s save plans).

Anything else raises :class:`RestrictedPayloadError` naming the global, and the fix. This
layer stands alone (no ``prism_launch`` import): the rank installs it when its plan says the
trace is not trusted.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle

from nccl_ext.core.errors import RestrictedPayloadError

__all__ = ["ALLOWED_PREFIXES", "RestrictedPayloadError", "RestrictedUnpickler", "install", "installed", "loads", "uninstall"]

ALLOWED_PREFIXES = ("megatron", "deepspeed", "torchtitan", "torch.distributed.checkpoint")
"""Modules whose dataclasses and enums a restricted payload may hold."""

_ALLOWED = frozenset({
    *(f"builtins.{n}" for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str",
                                "bytes", "bytearray", "bool", "slice", "range", "object")),
    "copyreg._reconstructor", "copyreg.__newobj__", "copyreg.__newobj_ex__", "_codecs.encode",
    "argparse.Namespace", "collections.OrderedDict", "collections.defaultdict", "collections.deque",
    *(f"datetime.{n}" for n in ("datetime", "date", "time", "timedelta", "timezone")),
    "pathlib.PurePosixPath", "pathlib.PosixPath", "pathlib.PurePath", "pathlib.Path",  # no I/O when built
    # Python 3.13 pickles them under the module that defines them
    "pathlib._local.PurePosixPath", "pathlib._local.PosixPath", "pathlib._local.PurePath", "pathlib._local.Path",
    "torch.Size", "torch.device", "torch.Tensor", "torch.nn.parameter.Parameter",
    *(f"torch._utils.{n}" for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter",
                                    "_rebuild_parameter_with_state", "_rebuild_device_tensor_from_numpy",
                                    "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_meta_tensor_no_storage")),
    "torch._tensor._rebuild_from_type_v2", "torch.serialization._get_layout",
    *(f"numpy.{core}.{n}" for core in ("_core.multiarray", "core.multiarray") for n in ("_reconstruct", "scalar")),
    *(f"numpy.{core}.numeric._frombuffer" for core in ("_core", "core")),
    "numpy.ndarray", "numpy.dtype",
})  # fmt: skip


def _refuse(what: str) -> RestrictedPayloadError:
    return RestrictedPayloadError(
        f"an object-collective payload of this trace names {what}, which an unsigned or foreign trace may not "
        "load (a trace's pickles run code when unpickled; only plain data, tensors and the frameworks' dataclasses "
        "are allowed). Re-capture the trace yourself, or pass trace.trusted=true if you trust the trace's author")


_STORAGE_LOADERS = frozenset({"torch.storage._load_from_bytes", "megatron.core.safe_globals.safe_load_from_bytes"})
"""How a pickled tensor storage names its loader: torch's own, or megatron-core 0.19's (it registers
``safe_load_from_bytes``, a ``torch.load(weights_only=True)``, for storages). Both are served by
:func:`_load_storage_bytes`; neither function is imported."""


def _load_storage_bytes(b: bytes):
    """``torch.storage._load_from_bytes`` under torch's weights-only allow-list."""
    import torch

    return torch.load(io.BytesIO(b), weights_only=True)


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals come from the allow-list of the module docstring."""

    def find_class(self, module: str, name: str):
        if (module, name) in _compat_pickle.NAME_MAPPING:  # Python 2 names (protocols 0-2), as pickle maps them
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full in _ALLOWED:
            return super().find_class(module, name)
        if full in _STORAGE_LOADERS:
            return _load_storage_bytes
        if "__" in name:  # dotted qualnames may not reach into dunders (Cls.__init__.__globals__)
            raise _refuse(full)
        if module == "torch._utils" and name.startswith("torch."):  # how torch 2.13 pickles a memory format
            module, name = "torch", name.removeprefix("torch.")
        if module == "torch" and "." not in name:
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        elif module == "numpy.dtypes":
            import numpy

            value = super().find_class(module, name)
            if isinstance(value, type) and issubclass(value, numpy.dtype):
                return value
        elif any(module == p or module.startswith(p + ".") for p in ALLOWED_PREFIXES):
            import dataclasses
            import enum

            value = super().find_class(module, name)  # imports a module of an allowed framework
            if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                return value
        raise _refuse(full)


def loads(data: bytes):
    """``pickle.loads`` through :class:`RestrictedUnpickler`."""
    return RestrictedUnpickler(io.BytesIO(data)).load()


def install() -> None:
    """Route torch.distributed's object collectives through :class:`RestrictedUnpickler`."""
    import torch.distributed.distributed_c10d as c10d

    if not hasattr(c10d, "_unpickler"):  # never run an untrusted trace unprotected
        import torch

        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.distributed_c10d._unpickler to "
                           "restrict: this trace's object payloads cannot be checked. Re-capture the trace yourself, "
                           "or pass trace.trusted=true if you trust its author")
    c10d._unpickler = RestrictedUnpickler


def installed() -> bool:
    import torch.distributed.distributed_c10d as c10d

    return getattr(c10d, "_unpickler", None) is RestrictedUnpickler


def uninstall() -> None:
    import torch.distributed.distributed_c10d as c10d

    if installed():
        c10d._unpickler = pickle.Unpickler
