"""Post-import patching: run a function on a module right after it is first imported.

``after_import(name, patch)`` calls ``patch(module)`` at once when ``name`` is already in
``sys.modules``, else exactly once right after the module's code has run, before the
``import`` statement that loaded it returns (so no importer sees it unpatched). A
``(name, patch)`` pair runs once however often it is registered; several patches of one
module run in registration order. Registering is thread-safe, and the patches themselves
run outside the registry's lock (an import under the module's own import lock).

One finder at the front of ``sys.meta_path`` serves every registration. It answers only for
names with patches still pending and otherwise leaves the lookup to the other finders; for a
pending name it takes the spec they find and runs the pending patches after the loader's
``exec_module``. The wrapped loader is visible only while the module executes: afterwards
``module.__loader__`` and ``module.__spec__.loader`` are the original loader again.

``replaces(owner, name)`` is how a patch swaps one function or method for a wrapper of it,
once, whoever asks again.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["after_import", "replaces", "MARK"]

Patch = Callable[[ModuleType], object]

_LOCK = threading.Lock()
_PENDING: dict[str, list[Patch]] = {}  # module name -> patches waiting for its import
_CLAIMED: set[tuple[str, Patch]] = set()  # (module name, patch) already run or running


def _claim(name: str, patches) -> list[Patch]:
    """The patches of ``patches`` not yet run for ``name``, marked as run (call under _LOCK)."""
    out = []
    for patch in patches:
        if (name, patch) not in _CLAIMED:
            _CLAIMED.add((name, patch))
            out.append(patch)
    return out


def _run_pending(name: str, module: ModuleType) -> None:
    with _LOCK:
        todo = _claim(name, _PENDING.pop(name, ()))
    for patch in todo:
        patch(module)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then its pending patches."""

    def __init__(self, name: str, loader):
        self._name = name
        self._loader = loader

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        _run_pending(self._name, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(fullname, spec.loader)
                return spec
        return None


_FINDER = _Finder()


def after_import(module_name: str, patch_fn: Patch) -> None:
    """Run ``patch_fn(module)`` now if ``module_name`` is imported, else right after its import."""
    with _LOCK:
        if (module_name, patch_fn) in _CLAIMED:
            return
        module = sys.modules.get(module_name)
        if module is not None:  # with any patches an import past the finder left pending
            todo = _claim(module_name, [*_PENDING.pop(module_name, ()), patch_fn])
        else:
            pending = _PENDING.setdefault(module_name, [])
            if patch_fn not in pending:
                pending.append(patch_fn)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    for patch in todo:
        patch(module)


MARK = "__prism_patched__"
"""The attribute that marks a replacement made by :func:`replaces`."""


def replaces(owner: Any, name: str) -> Callable[[Callable], Callable | None]:
    """Decorator: ``owner.<name>`` becomes a function calling ``impl(original, *args, **kwargs)``
    (a method stays a method: ``self`` is the first of ``args``). Done once: where ``owner.<name>``
    is already a replacement (:data:`MARK`) or absent, nothing changes and the decorator gives
    None. The replacement carries the original's name and docstring, and ``__wrapped__``."""

    def decorate(impl: Callable) -> Callable | None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, MARK, False):
            return None
        if isinstance(vars(owner).get(name) if hasattr(owner, "__dict__") else None, (staticmethod, classmethod)):
            raise TypeError(f"replaces({getattr(owner, '__name__', owner)!r}, {name!r}): a staticmethod or "
                            "classmethod would become an instance method; wrap its function in the right decorator")

        @functools.wraps(original)
        def replacement(*args, **kwargs):
            return impl(original, *args, **kwargs)

        setattr(replacement, MARK, True)
        setattr(owner, name, replacement)
        return replacement

    return decorate
