"""A sandbox rank's divergence checks on the host path: its live contribution (or send) against
the recording — the digest first; on a mismatch the recorded tensors when the trace stores them,
else the statistics it keeps of them (``capture.payload=exact`` stores only what the sandbox
consumes: :func:`nccl_ext.replay.divergence.piece_stats` of its own data)."""

from __future__ import annotations

from typing import Protocol

import torch

from nccl_ext.core import wire
from nccl_ext.core.errors import DivergenceError
from nccl_ext.replay.recording import RecordedOp


class CheckingRank(Protocol):
    """What the checks use of the replay transport (:class:`~nccl_ext.replay.transport.ReplayTransport`)."""
    rank: int
    unit: int
    recording: object
    divergences: object

    def diverged(self, what: str, group, seq: int, detail: str, kind=..., site: str | None = None,
                 diff: dict | None = None) -> None:
        """Report a divergence of op ``what`` (``seq`` on ``group``) to the rank's divergence log."""


def check_contribution(tr: CheckingRank, api: str, group, seq: int, gid: int, live: list[torch.Tensor],
                       own: RecordedOp) -> None:
    """Report a divergence of ``live`` from ``own``'s recorded contribution (``tr``: the replay
    transport); shapes or dtypes that differ raise :class:`~nccl_ext.core.errors.DivergenceError`."""
    shapes = [tuple(t.shape) for t in live]
    dtypes = [wire.dtype_name(t.dtype) for t in live]
    same_meta = shapes == [tuple(x) for x in own.shapes] and dtypes == list(own.dtypes)
    if own.digests and same_meta and [wire.digest(t) for t in live] == list(own.digests):
        return
    recorded = None if own.stats else tr.recording.contribution(tr.rank, gid, seq)
    if recorded is not None:
        same_meta = len(recorded) == len(live) and all(a.shape == b.shape and a.dtype == b.dtype
                                                        for a, b in zip(live, recorded))
    if not same_meta:
        raise DivergenceError(
            f"rank {tr.rank} at step {tr.unit}: {api} on group {group.desc or group.key} seq {seq}: "
            f"shapes {shapes} differ from the recorded {[tuple(x) for x in own.shapes]}; capture again")
    if recorded is None:
        tr.diverged(api, group, seq, "live contribution differs from the recorded one (its recorded statistics)",
                     *tr.divergences.classify_stats(live, own.shapes, own.dtypes, own.digests, own.stats))
    elif any(not torch.equal(a.cpu(), b) for a, b in zip(live, recorded)):
        tr.diverged(api, group, seq, "live contribution differs from the recorded one",
                     *tr.divergences.classify(live, recorded))


def check_send(tr: CheckingRank, group, seq: int, dst: int, tensor: torch.Tensor, rec: RecordedOp, load) -> None:
    """Report a divergence of a send to a virtual rank from the recorded one (``load``: the
    recorded payload's loader, None when the trace keeps only its statistics)."""
    if rec.digests == (wire.digest(tensor),):
        return
    live = tensor.detach().cpu()
    detail = f"payload to rank {dst} differs from the recorded one"
    if load is None:
        tr.diverged("send", group, seq, detail + " (its recorded statistics)",
                     *tr.divergences.classify_stats([live], rec.shapes, rec.dtypes, rec.digests, rec.stats))
        return
    recorded = load()  # digests differ (or are of another kind): compare the bytes themselves
    if live.shape != recorded.shape or live.dtype != recorded.dtype or not torch.equal(live, recorded):
        tr.diverged("send", group, seq, detail, *tr.divergences.classify([live], [recorded]))


def refs(rec: RecordedOp, load) -> list:
    """What the device checks compare a mismatching piece with: the recorded pieces, or their
    recorded L1 norms when the trace keeps only statistics (None for integer data)."""
    return [st[1] for st in rec.stats] if rec.stats else load()
