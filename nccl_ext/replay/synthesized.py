"""The emulation side of ``payload=none``: a sandbox rank's ops completed from its own
contributions (:mod:`nccl_ext.core.synth`), exactly as its capture computed them, so a
deterministic program's sandbox outputs equal its capture's; the virtual members' recorded
timing still delays completion (``emulate.timing``).

Every op is synthesized, including ops shared with other sandbox ranks (the capture
synthesized those too): sandbox ranks exchange nothing. Broadcasts the capture carried come
back from the trace (``r/<group>/<seq>/<i>`` of the receiving rank). The live contribution's
shapes are checked against the recorded ones; there are no recorded values to compare."""

from __future__ import annotations

from typing import Protocol

from nccl_ext.core import routing_counts, synth
from nccl_ext.core.errors import DivergenceError
from nccl_ext.core.pending import Pending
from nccl_ext.core.call import CollectiveCall


class SynthesizingRank(Protocol):
    """What these ops use of the replay transport (:class:`~nccl_ext.replay.transport.ReplayTransport`)."""
    rank: int
    stats: object
    recording: object
    carry_bytes: int
    timeout_s: float
    timing: str
    time_scale: float

    def note_unit_start(self) -> None: ...

    def delay_for(self, own, others: list) -> float:
        """Seconds the op completes after its issue (the recorded lag of its latest member)."""

    def virtual_ops(self, group, gid: int, seq: int) -> list: ...

    def finish_after(self, pending: Pending, value, delay: float) -> None: ...


def collective(tr: SynthesizingRank, group, gid: int, seq: int, call: CollectiveCall, own, what: str) -> Pending:
    """``own``: this rank's recorded op."""
    me = group.group_rank(tr.rank)
    if call.tensors is not None and own.shapes:
        shapes = [tuple(t.shape) for t in call.tensors]
        if shapes != [tuple(s) for s in own.shapes]:
            raise DivergenceError(f"{what}: shapes {shapes} differ from the recorded {[tuple(s) for s in own.shapes]}; "
                        "capture again")
    tr.stats.ops += 1
    tr.stats.synthesized += 1
    tr.note_unit_start()
    delay = tr.delay_for(own, tr.virtual_ops(group, gid, seq))
    result = None
    if (synth.carried(call, tr.carry_bytes) or routing_counts.carried_counts(call.kind, call.tensors, group.desc)) \
            and me != call.root:
        result = tr.recording.result(tr.rank, gid, seq) or None  # the payload the capture carried
        if result is not None:
            tr.stats.carried += 1
    if result is None:
        result = synth.results(call, group.size, me)
    call.tensors = None
    pending = Pending(what, tr.timeout_s)
    tr.finish_after(pending, result, delay)
    return pending


def send(tr: SynthesizingRank, group, gid: int, dst: int, tag: int, seq: int, tensor) -> Pending:
    rec = tr.recording.sent(gid, tr.rank, dst, tag, seq)
    what = f"rank {tr.rank}: send #{seq} to rank {dst} tag {tag} on group {group.desc or group.key}"
    if rec is None:
        raise DivergenceError(f"{what}: not in the trace; capture again")
    if rec[0].shapes and tuple(tensor.shape) != tuple(rec[0].shapes[0]):
        raise DivergenceError(f"{what}: shape {tuple(tensor.shape)} differs from the recorded {tuple(rec[0].shapes[0])}")
    tr.stats.synthesized += 1
    return Pending.done("send")


def recv(tr: SynthesizingRank, group, gid: int, src: int, tag: int, seq: int, like, what: str) -> Pending:
    own = tr.recording.received(tr.rank, gid, src, tag, seq)
    if own is None:
        raise DivergenceError(f"{what}: not in the trace; capture again")
    sent = tr.recording.sent(gid, src, tr.rank, tag, seq)
    delay = 0.0
    if sent is not None and tr.timing != "none":
        delay = max(0.0, sent[0].t_start - own.t_start) * tr.time_scale
    tr.stats.synthesized += 1
    pending = Pending(what, tr.timeout_s)
    tr.finish_after(pending, [synth.fill(like)], delay)
    return pending
