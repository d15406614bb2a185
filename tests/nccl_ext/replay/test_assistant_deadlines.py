"""The assistant waits for a sandbox rank to take a message only until the rank's recorded pace
says it is due (nccl_ext/replay/assistant.py, Pace): a rank still running that never takes it
fails the assistant naming the rank, the op and how late it is; a rank that keeps its pace is
waited for however long it computes."""

import threading
import time

import pytest

from nccl_ext.core.errors import CommDeadlineError
from nccl_ext.replay.assistant import PACE_SLACK, ended_within, serve
from tests.nccl_ext.deadline_fakes import TinyRecording, _op


class Recording(TinyRecording):
    """Sandbox rank 0's all-reduces with virtual rank 1, recorded at ``starts``."""

    def __init__(self, starts):
        super().__init__((0, 1))
        self.starts = starts

    def ops_of(self, rank):
        return [(_op("all_reduce", "allreduce", i, t_start=t), 0, i, -1, 0) for i, t in enumerate(self.starts)]

    def contribution(self, rank, gid, seq):
        return super().contribution(rank, gid, 0)


class Work:
    made: list["Work"] = []

    def __init__(self, taken_after):
        self.taken_after = taken_after
        self.never = threading.Event()
        Work.made.append(self)

    def wait(self, timeout=None):
        if self.taken_after is None:
            self.never.wait(30)  # the sandbox never enters the op
        else:
            time.sleep(self.taken_after)
        return True


class Physical:
    """The gloo group: message ``i`` is taken ``taken_after[i]`` s after it is posted (None: never)."""

    def __init__(self, taken_after):
        self.taken_after, self.works = list(taken_after), []

    def send(self, bufs, dst, tag):
        self.works.append(Work(self.taken_after[len(self.works)]))
        return self.works[-1]


@pytest.fixture(autouse=True)
def _end_the_waits():
    """A failed serve() leaves its send threads waiting on messages never taken (the assistant's
    process would end there): release them, so they do not outlive the test."""
    yield
    for w in Work.made:
        w.never.set()
    Work.made.clear()


class Store:
    def check(self, keys):
        return False  # the sandbox rank is still running


def test_a_rank_that_never_takes_its_first_message_fails_the_assistant_by_its_due_time():
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError, match=r"deadline exceeded: the assistant: sandbox rank 0 had not taken the "
                       r"recorded data for op #0 \(allreduce on group 0 seq 0, step 0\) .* before the rank took any"):
        serve(Recording([0.0]), (0,), Physical([None]), Store(), timeout_s=0.1)
    assert PACE_SLACK * 0.1 - 0.05 < time.monotonic() - t0 < 3.0


def test_a_later_message_is_due_by_the_ranks_recorded_pace():
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError, match=r"sandbox rank 0 had not taken the recorded data for op #1 .* after "
                       r"it took op #0 .* in the capture it reached this op 0.2 s after that one") as e:
        serve(Recording([0.0, 0.2]), (0,), Physical([0.0, None]), Store(), timeout_s=0.1)
    assert time.monotonic() - t0 < 3.0 and e.value.rank == 0


def test_a_rank_that_keeps_its_pace_is_waited_for():
    # each op 0.3 s after the previous (recorded 0.2 s: due 4 x 0.2 + 0.1 = 0.9 s after)
    stats = serve(Recording([0.0, 0.2, 0.4]), (0,), Physical([0.05, 0.3, 0.3]), Store(), window=1, timeout_s=0.1)
    assert stats.streams[0].messages == 3


def test_a_ring_op_cut_by_the_first_sandbox_to_end_waits_for_the_others_to_end():
    """The first sandbox rank to end closes the connection a ring op waits on; the op is
    reported as not played only once every sandbox rank has ended within the grace."""
    t0 = time.monotonic()
    assert ended_within(lambda: time.monotonic() - t0 > 0.3, grace_s=5.0)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    assert not ended_within(lambda: False, grace_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
