"""Admission by device memory: a capture never puts more ranks on a GPU than its free memory
holds (from measured peaks), runs a probe first, and when every admitted rank is blocked
starts the rank they wait for, not an arbitrary one."""

from prism_launch.capture.slots import MemoryAdmission, SlotScheduler

GIB = 1 << 30
NO_PID = 1 << 30
"""Process ids above Linux's pid_max (at most 2**22): no such process, so an ended rank's memory is free at once."""


class _Conn:
    def __init__(self):
        self.sent = []

    def send_bytes(self, *a, **k):
        self.sent.append(a)


def _sched(budget_gib, slots=8):
    adm = MemoryAdmission([budget_gib * GIB], lambda r: 0, overhead=GIB)
    s = SlotScheduler(slots, admission=adm)
    sent = {}

    def arrive(rank):
        conn = _Conn()
        sent[rank] = conn
        s.arrive(rank, NO_PID + rank, conn)

    return s, adm, arrive


def _started(s):
    return set(s.running)


def test_a_probe_runs_alone_then_ranks_are_admitted_by_their_measured_peak(monkeypatch):
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): None)
    s, adm, arrive = _sched(20)
    for r in (7, 3, 5, 4, 6):
        arrive(r)
    s.schedule()
    assert _started(s) == {3}  # rank order; one until a peak is known
    adm.report(3, {"peak_reserved_bytes": 5 * GIB})
    s.gone(3)
    s.schedule()
    assert _started(s) == {4, 5, 6}  # 3 x (5 + 1) GiB fit in 20, a fourth does not
    assert not adm.admit(7)
    s.gone(4)
    s.schedule()
    assert 7 in _started(s)
    assert adm.max_admitted == 3 and adm.forced == 0


def test_when_every_admitted_rank_is_blocked_the_awaited_rank_starts(monkeypatch):
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): None)
    s, adm, arrive = _sched(10)
    for r in (0, 1, 2, 3):
        arrive(r)
    s.schedule()
    assert _started(s) == {0}
    s.issued(0, 11)
    s.awaits(3)  # rank 0 waits for a broadcast whose payload rank 3 holds
    s.park(0, 11)
    s.schedule()
    assert _started(s) == {3}  # not rank 1: it would not unblock anyone
    assert adm.forced == 1


def test_a_measured_rank_that_does_not_fit_waits_while_others_run(monkeypatch):
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): None)
    s, adm, arrive = _sched(10)
    adm.report(9, {"peak_bytes": 6 * GIB})  # a peak known from before
    for r in (1, 2):
        arrive(r)
    s.schedule()
    assert _started(s) == {1}  # 2 x 7 GiB > 10 GiB
    assert adm.waiting
    s.gone(1)
    s.schedule()
    assert _started(s) == {2}


def test_admission_waits_for_every_rank_to_connect_then_starts_in_rank_order(monkeypatch):
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): None)
    adm = MemoryAdmission([10 * GIB], lambda r: 0, overhead=GIB)
    s = SlotScheduler(8, admission=adm, expected=3)
    s.arrive(5, NO_PID + 5, _Conn())  # the first to connect is not the lowest rank
    s.schedule()
    assert not s.running
    s.arrive(4, NO_PID + 4, _Conn())
    s.arrive(6, NO_PID + 6, _Conn())
    s.schedule()
    assert s.running == {4}


def test_a_blocked_rank_waits_for_an_awaited_rank_that_has_not_connected(monkeypatch):
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): None)
    s, adm, arrive = _sched(10)
    arrive(1)
    arrive(2)
    s.schedule()
    s.issued(1, 5)
    s.awaits(0)  # rank 0 holds the payload but has not connected yet
    s.park(1, 5)
    s.schedule()
    assert not s.running and adm.forced == 0  # starting rank 2 would not unblock anyone
    arrive(0)
    s.schedule()
    assert s.running == {0}


def test_the_budget_is_read_again_once_every_rank_has_connected(monkeypatch):
    """Ranks waiting for their first slot already hold device memory (their CUDA contexts): the
    budget is what is free once they have all connected, not what was free before they started."""
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): None)
    reads = iter([[14 * GIB]])
    adm = MemoryAdmission([20 * GIB], lambda r: 0, overhead=GIB, free=lambda: next(reads))
    s = SlotScheduler(8, admission=adm, expected=4)
    for r in range(3):
        s.arrive(r, NO_PID + r, _Conn())
    s.schedule()
    assert not s.running and adm.budget == [20 * GIB]  # still gathering: nothing read yet
    s.arrive(3, NO_PID + 3, _Conn())
    s.schedule()
    assert s.running == {0} and adm.budget == [14 * GIB]
    adm.report(0, {"peak_reserved_bytes": 5 * GIB})
    s.gone(0)
    s.schedule()
    assert s.running == {1, 2}  # 2 x 6 GiB fit in the 14 GiB free, not the 20 read at the start
    assert adm.to_dict()["budget_refreshed"] is True


def test_a_rank_answered_before_its_park_arrives_keeps_its_slot(monkeypatch):
    """A carried broadcast's root is answered at once, before its park message is read: the rank
    is not blocked. It keeps its slot and no other rank is started past the device's memory
    (the H200 capture of a Llama-3-8B shape ran 32 ranks onto the card this way)."""
    sent = []
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): sent.append((conn, header)))
    s, adm, arrive = _sched(20)
    for r in range(4):
        arrive(r)
    s.schedule()
    assert s.running == {0}
    for op in range(5):  # five micro-batches, each a broadcast answered before the park
        s.issued(0, op)
        s.answered(0, op)
        s.park(0, op)
        s.schedule()
    assert s.running == {0} and adm.forced == 0 and len(adm.admitted) == 1
    goes = [h for _c, h in sent if h == ("go",)]
    assert len(goes) == 6  # the first slot, then one at once for each park that found its op done


def test_a_started_rank_resumes_before_ranks_that_have_not_started(monkeypatch):
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): None)
    s, adm, arrive = _sched(20)
    for r in range(3):
        arrive(r)
    s.schedule()
    adm.report(0, {"peak_reserved_bytes": 5 * GIB})
    s.issued(0, 7)
    s.park(0, 7)  # blocked for real
    s.schedule()
    assert 0 not in s.running
    s.answered(0, 7)
    s.schedule()
    assert 0 in s.running and adm.forced == 0


def test_an_ended_rank_holds_its_memory_until_its_process_has_exited(monkeypatch):
    """A rank that said goodbye still holds its peak while its process tears down: the next rank
    is admitted once the process is gone (a zombie counts as gone), and nobody is forced in
    meanwhile."""
    import subprocess
    import sys

    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): None)
    adm = MemoryAdmission([10 * GIB], lambda r: 0, overhead=GIB)
    s = SlotScheduler(8, admission=adm)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        s.arrive(0, proc.pid, _Conn())
        s.arrive(1, NO_PID + 1, _Conn())
        s.schedule()
        assert s.running == {0}
        adm.report(0, {"peak_reserved_bytes": 8 * GIB})
        s.gone(0)  # its process lives on
        s.schedule()
        assert s.running == set() and adm.forced == 0 and 0 in adm.admitted
        proc.stdin.close()
        proc.wait(timeout=30)  # reaped: /proc has no such process
        s.schedule()
        assert s.running == {1} and adm.forced == 0
    finally:
        proc.kill()


def test_ranks_stop_parking_once_every_rank_runs_with_a_slot_of_its_own(monkeypatch):
    sent = []
    monkeypatch.setattr("nccl_ext.core.wire.send", lambda conn, header, tensors=(): sent.append((conn.rank, header)))

    def scheduler(slots, expected):
        s = SlotScheduler(slots, expected=expected)
        for r in range(expected):
            conn = _Conn()
            conn.rank = r
            s.arrive(r, NO_PID + r, conn)
        return s

    s = scheduler(slots=4, expected=3)
    s.schedule()
    assert s.unparked_at is not None
    assert [h for _r, h in sent] == [("go",)] * 3 + [("free",)] * 3
    sent.clear()
    s.schedule()
    assert not sent  # said once

    s = scheduler(slots=2, expected=3)  # a slot handed back goes to the third rank: keep parking
    s.schedule()
    assert s.unparked_at is None and ("free",) not in [h for _r, h in sent]
    s.issued(0, 7)
    s.park(0, 7)
    s.schedule()
    assert s.unparked_at is None and 2 in s.running  # all started, but rank 0 waits for a slot
