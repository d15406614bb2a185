"""Divergences by kind: what a sandbox rank reports when a live contribution differs from the
recorded one (:class:`DivergenceLog`), and the rule that sorts each into one of three kinds
(:class:`Kind`):

* ``value`` — the live data is not the recorded data beyond the tolerance: the program took
  another path, or its numbers changed. The only kind ``emulate.strict=true`` fails on.
* ``tolerance`` — floating-point data that differs from the recording by no more than the
  tolerance: non-deterministic kernels (atomics in MoE permutation/unpermutation, split-K
  reductions), where re-running the same inputs gives bits that differ in the last places.
  Host path: every element, ``max |live - recorded| <= rtol * max |recorded|`` (a norm-wise
  bound, so elements near zero do not inflate it). Device path (only a 32-bit word sum and
  the live tensor's L1 norm are taken on the device, no host copy): ``| ||live||_1 -
  ||recorded||_1 | <= rtol * ||recorded||_1`` — a necessary condition for closeness, blind to
  permutations as the word sum is.
  A trace that keeps only statistics of this rank's contribution (``capture.payload=exact``
  stores the tensors the sandbox consumes, not the ones it produces: :func:`piece_stats`) is
  judged the same way on the host path: the live piece's L1 norm and max-abs value against the
  recorded ones, each within the tolerance (:meth:`DivergenceLog.classify_stats`).
* ``host_scalar`` — a small contribution (at most ``host_scalar_max_elements`` elements) issued
  from a call site listed in ``host_scalar_sites``: values that carry wall-clock times or
  rank-local counters, which no replay can reproduce. The rule is by size *and* context (the
  first Python frame outside torch and this project — file and function — taken only for
  small tensors), never by looking at the values: a small loss all-reduce stays a ``value``
  divergence. A site is a path fragment of the file (every function in it) or
  ``fragment:function``. Default sites, read in megatron-core 0.16.1's ``core/timers.py`` and
  Megatron-LM's ``training/training.py`` (the 0.19 tree bench/gpu_upstream.py runs):
  ``megatron/core/timers.py`` (``Timers._get_elapsed_time_all_ranks`` all-gathers every
  rank's float32 elapsed times, one per timer name; Megatron logs ~25 names),
  ``training.py:pretrain`` (the program and training start times, float64 MIN all-reduces) and
  ``training.py:checkpoint_and_decide_exit`` (the exit-duration flag, from the wall clock).
  Not ``training.py:train_step``, which all-reduces the loss and token count (2 elements).

A deterministic run has no mismatch, so every kind counts exactly zero.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from enum import StrEnum

import torch

from nccl_ext.core.errors import DivergenceError

HOST_SCALAR_SITES = ("megatron/core/timers.py", "megatron/training/training.py:pretrain",
                     "megatron/training/training.py:checkpoint_and_decide_exit")
"""Default call sites whose small collectives carry wall-clock times or counters."""
HOST_SCALAR_MAX_ELEMENTS = 64
"""Default size limit of a host scalar (Megatron logs ~25 timers in one all-gather)."""
DEFAULT_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
"""Tolerance by dtype when ``emulate.divergence_rtol`` is unset: a few thousand ulps of fp32,
a few of bf16/fp16 (whose sums round at 2**-8 / 2**-11 relative)."""
_SKIP = ("/torch/", "/nccl_ext/", "/prism_launch/", "/integrations/")
FIRST_DETAILS = 8
"""Divergences of each kind kept in full (step, op, group, differences); the rest are counted."""


class Kind(StrEnum):
    value = "value"
    tolerance = "tolerance"
    host_scalar = "host_scalar"


def call_site(numel: int, limit: int = HOST_SCALAR_MAX_ELEMENTS) -> str | None:
    """``file:line:function`` of the program frame that issued the current collective, for
    contributions of at most ``limit`` elements (else None: large ops pay nothing)."""
    if numel > limit:
        return None
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if not any(s in name for s in _SKIP):
            return f"{name}:{f.f_lineno}:{f.f_code.co_name}"
        f = f.f_back
    return None


def site_matches(site: str, rule: str) -> bool:
    """Whether ``site`` (``file:line:function``) is in ``rule`` (``fragment`` or ``fragment:function``)."""
    file, _line, function = site.rsplit(":", 2)
    fragment, _, fn = rule.partition(":")
    return fragment in file and (not fn or fn == function)


def rtol_for(dtype: torch.dtype, rtol: float | None) -> float:
    """The configured tolerance, or the dtype's default; 0 for integer data (exact only)."""
    if not dtype.is_floating_point:
        return 0.0
    return rtol if rtol is not None else DEFAULT_RTOL.get(dtype, 1e-4)


@dataclass(frozen=True, slots=True)
class Difference:
    max_abs: float
    max_rel: float
    """Largest |live - recorded| / |recorded| over the elements whose recorded value is not 0."""
    scale: float
    """max |recorded| (host path) or ||recorded||_1 (device path): what the tolerance scales."""


def difference(live: torch.Tensor, recorded: torch.Tensor) -> Difference:
    a, b = live.detach().cpu().double().reshape(-1), recorded.detach().cpu().double().reshape(-1)
    d = (a - b).abs()
    nz = b != 0
    rel = float((d[nz] / b[nz].abs()).max()) if bool(nz.any()) else (0.0 if not bool(d.any()) else float("inf"))
    return Difference(float(d.max()) if d.numel() else 0.0, rel, float(b.abs().max()) if b.numel() else 0.0)


def l1(t: torch.Tensor) -> float:
    """The statistic the device path takes of a live floating contribution (host side, float64)."""
    return float(t.detach().cpu().double().abs().sum())


def piece_stats(t: torch.Tensor) -> list:
    """What a trace keeps of a contribution piece it does not store, for the divergence checks:
    ``[word sum, L1 norm, max |x|]`` (the device path's checksum; the norms float64, None for
    non-floating data). The CRC digest beside it decides equality."""
    from nccl_ext.device_path.checks import word_sum

    t = t.detach().cpu()
    if not t.dtype.is_floating_point or not t.numel():
        return [word_sum(t), None, None]
    # the norm accumulates in float64 without a float64 copy of the data, the max-abs from the
    # extremes (exact in any dtype): 4x cheaper than on an upcast copy — the capture takes it of
    # every contribution a sandbox rank makes
    lo, hi = torch.aminmax(t)
    return [word_sum(t), float(torch.linalg.vector_norm(t, 1, dtype=torch.float64)), max(abs(float(lo)), abs(float(hi)))]


def _rel(live: float, recorded: float) -> float:
    return abs(live - recorded) / recorded if recorded else (0.0 if live == 0 else float("inf"))


class DivergenceLog:
    """One sandbox rank's divergences, by kind: counts, the first few of each in full (into
    ``stats.divergences``), a warning per (op, group) and, in strict mode, an error on the first
    ``value`` divergence."""

    def __init__(self, rank: int, stats, *, strict: bool, rtol: float | None = None,
                 sites: tuple[str, ...] = HOST_SCALAR_SITES, max_elements: int = HOST_SCALAR_MAX_ELEMENTS,
                 error: type[Exception] = DivergenceError):
        self.rank, self.stats, self.strict, self.rtol = rank, stats, strict, rtol
        self.sites, self.max_elements, self._error = tuple(sites), max_elements, error
        self._warned: set[tuple[str, str, str]] = set()

    def site(self, tensors: list[torch.Tensor]) -> str | None:
        """The call site, when the contribution is small enough to be a host scalar."""
        return call_site(sum(t.numel() for t in tensors), self.max_elements)

    def host_scalar(self, numel: int, site: str | None) -> bool:
        return site is not None and numel <= self.max_elements and any(site_matches(site, s) for s in self.sites)

    def classify(self, live: list[torch.Tensor], recorded: list[torch.Tensor]) -> tuple[Kind, str | None, dict]:
        """Host path: kind, call site and differences of a mismatching contribution (both sides
        at hand; shapes or dtypes that differ are a ``value`` divergence)."""
        site = self.site(live)
        if len(live) != len(recorded) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(live, recorded)):
            return Kind.value, site, {}
        pairs = [(a, difference(a, b)) for a, b in zip(live, recorded) if not torch.equal(a.cpu(), b.cpu())]
        diff = {"max_abs_diff": max((d.max_abs for _, d in pairs), default=0.0),
                "max_rel_diff": max((d.max_rel for _, d in pairs), default=0.0)}
        if self.host_scalar(sum(t.numel() for t in live), site):
            return Kind.host_scalar, site, diff
        ok = all(a.dtype.is_floating_point and d.max_abs <= rtol_for(a.dtype, self.rtol) * d.scale for a, d in pairs)
        return (Kind.tolerance if ok and pairs else Kind.value), site, diff

    def classify_stats(self, live: list[torch.Tensor], shapes, dtypes, digests, stats) -> tuple[Kind, str | None, dict]:
        """Host path, against a recording that kept only the digest and :func:`piece_stats` of
        each piece: ``tolerance`` when every piece whose digest differs is floating data whose L1
        norm and max-abs value are both within the tolerance of the recorded ones; ``value``
        otherwise (shapes or dtypes that differ, integer data, no statistics)."""
        from nccl_ext.core import wire

        site = self.site(live)
        if len(live) != len(shapes) or len(stats) != len(live) or len(digests) != len(live) or any(
                tuple(a.shape) != tuple(s) or wire.dtype_name(a.dtype) != d for a, s, d in zip(live, shapes, dtypes)):
            return Kind.value, site, {}
        l1_rel = max_rel = 0.0
        ok = True
        for a, digest, (_ws, rec_l1, rec_max) in zip(live, digests, stats):
            if wire.digest(a) == digest:
                continue
            if rec_l1 is None or not a.dtype.is_floating_point:
                ok = False
                continue
            _, live_l1, live_max = piece_stats(a)
            r1, rm = _rel(live_l1, rec_l1), _rel(live_max, rec_max)
            l1_rel, max_rel = max(l1_rel, r1), max(max_rel, rm)
            tol = rtol_for(a.dtype, self.rtol)
            ok = ok and r1 <= tol and rm <= tol
        diff = {"l1_rel_diff": l1_rel, "max_abs_rel_diff": max_rel}
        if self.host_scalar(sum(t.numel() for t in live), site):
            return Kind.host_scalar, site, diff
        return (Kind.tolerance if ok else Kind.value), site, diff

    def classify_norms(self, dtype: torch.dtype, live_l1: float | None, recorded: torch.Tensor | float | None,
                       numel: int, site: str | None) -> tuple[Kind, str | None, dict]:
        """Device path: kind of a contribution piece whose word sum mismatched, from the live
        piece's L1 norm (None: not taken, integer data) and the recorded piece (or its recorded
        L1 norm: :func:`piece_stats`)."""
        if self.host_scalar(numel, site):
            return Kind.host_scalar, site, {}
        if live_l1 is None or not dtype.is_floating_point or recorded is None:
            return Kind.value, site, {}
        ref = recorded if isinstance(recorded, float) else l1(recorded)
        rel = abs(live_l1 - ref) / ref if ref else (0.0 if live_l1 == 0 else float("inf"))
        return (Kind.tolerance if rel <= rtol_for(dtype, self.rtol) else Kind.value), site, {"l1_rel_diff": rel}

    def report(self, kind: Kind, *, step: int, op: str, group, seq: int, detail: str, site: str | None = None,
               **diff) -> None:
        counts = self.stats.divergence_counts
        counts[kind.value] = counts.get(kind.value, 0) + 1
        if counts[kind.value] <= FIRST_DETAILS:
            self.stats.divergences.append({"kind": kind.value, "step": step, "op": op, "group": list(group.ranks),
                                           "group_desc": group.desc, "seq": seq, "rank": self.rank,
                                           "detail": detail, "site": site, **diff})
        shown = ", ".join(f"{k} {v:.3g}" for k, v in diff.items() if isinstance(v, float))
        msg = (f"divergence ({kind.value}) on rank {self.rank} at step {step}: {op} on group "
               f"{group.desc or group.key} seq {seq}: {detail}" + (f" ({shown})" if shown else "")
               + (f" from {site}" if site and kind is Kind.host_scalar else ""))
        if self.strict and kind is Kind.value:
            raise self._error(msg + " (emulate.strict=true)")
        key = (kind.value, op, group.key)
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg + " — results combine the live value with recorded peers", stacklevel=3)
