"""A sandbox rank's mirrored collective: once the notes of its staged data are taken, the
coordinator tells the rank it may reuse the regions (``xfree``). A mirrored op does not wait for
the coordinator, so the rank may have finished and closed its connection by then: that is no
failure of the capture (it once ended one with a bare BrokenPipeError)."""

from multiprocessing import Pipe
from types import SimpleNamespace

from nccl_ext.core import wire
from prism_launch.capture.notes import TraceNotes
from prism_launch.capture.staged import StagedResults
from prism_launch.capture.synthesized import SynthesizedOps


def _ops():
    busy_s = {"digest": 0.0, "copy": 0.0, "record": 0.0}
    notes = TraceNotes(None, None, busy_s, lambda nbytes: None)
    staged = StagedResults(None, None, notes)
    return notes, SynthesizedOps(None, {}, None, notes, staged, None, busy_s, lambda nbytes: None, None, None)


def test_the_free_of_a_rank_that_has_exited_is_dropped_and_a_live_ranks_arrives():
    notes, ops = _ops()
    group = SimpleNamespace(id=2)
    gone, gone_peer = Pipe()
    gone_peer.close()
    live, live_peer = Pipe()
    for conn, op_id in ((gone, 3), (live, 4)):
        row, extra = {}, {"kind": "all_reduce"}
        ops.kept_mirrored(conn, 11, group, 7, (op_id, None, None), row, extra)
    notes.drain(wait=True)  # the coordinator's pump: nothing raised for the closed connection
    notes.drain(wait=True)
    assert wire.recv(live_peer)[0] == ("xfree", 4)
    notes.close()
