"""The emulation side of ``payload=none``: a sandbox rank's ops completed from its own
contributions (:mod:`nccl_ext.core.synth`), exactly as its capture computed them, so a
deterministic program's sandbox outputs equal its capture's; the virtual members' recorded
timing still delays completion (``emulate.timing``).

Every op is synthesized, including ops shared with other sandbox ranks (the capture
synthesized those too): sandbox ranks exchange nothing. Broadcasts the capture carried come
back from the trace (``r/<group>/<seq>/<i>`` of the receiving rank). The live contribution's
shapes are checked against the recorded ones; there are no recorded values to compare."""

from __future__ import annotations

from nccl_ext.core import synth
from nccl_ext.core.pending import Pending
from nccl_ext.core.call import CollectiveCall


def collective(tr, group, gid: int, seq: int, call: CollectiveCall, own, what: str, error) -> Pending:
    """``tr``: the :class:`~nccl_ext.replay.transport.ReplayTransport`; ``own``: this rank's
    recorded op; ``error``: the divergence error class."""
    me = group.group_rank(tr.rank)
    if call.tensors is not None and own.shapes:
        shapes = [tuple(t.shape) for t in call.tensors]
        if shapes != [tuple(s) for s in own.shapes]:
            raise error(f"{what}: shapes {shapes} differ from the recorded {[tuple(s) for s in own.shapes]}; "
                        "capture again")
    tr.stats.ops += 1
    tr.stats.synthesized += 1
    tr._note_unit_start()
    delay = tr._delay(own, tr._virtual_ops(group, gid, seq))
    result = None
    if synth.carried(call, tr.carry_bytes) and me != call.root:
        result = tr.recording.result(tr.rank, gid, seq) or None  # the payload the capture carried
        if result is not None:
            tr.stats.carried += 1
    if result is None:
        result = synth.results(call, group.size, me)
    call.tensors = None
    pending = Pending(what, tr.timeout_s)
    tr._finish_after(pending, result, delay)
    return pending


def send(tr, group, gid: int, dst: int, tag: int, seq: int, tensor, error) -> Pending:
    rec = tr.recording.sent(gid, tr.rank, dst, tag, seq)
    what = f"rank {tr.rank}: send #{seq} to rank {dst} tag {tag} on group {group.desc or group.key}"
    if rec is None:
        raise error(f"{what}: not in the trace; capture again")
    if rec[0].shapes and tuple(tensor.shape) != tuple(rec[0].shapes[0]):
        raise error(f"{what}: shape {tuple(tensor.shape)} differs from the recorded {tuple(rec[0].shapes[0])}")
    tr.stats.synthesized += 1
    return Pending.done("send")


def recv(tr, group, gid: int, src: int, tag: int, seq: int, like, what: str, error) -> Pending:
    own = tr.recording.received(tr.rank, gid, src, tag, seq)
    if own is None:
        raise error(f"{what}: not in the trace; capture again")
    sent = tr.recording.sent(gid, src, tr.rank, tag, seq)
    delay = 0.0
    if sent is not None and tr.timing != "none":
        delay = max(0.0, sent[0].t_start - own.t_start) * tr.time_scale
    tr.stats.synthesized += 1
    pending = Pending(what, tr.timeout_s)
    tr._finish_after(pending, [synth.fill(like)], delay)
    return pending
