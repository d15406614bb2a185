"""The device data path's close (nccl_ext/device_path/path.py) waits for its threads and its
helper threads' copies within a bound, names those still running, and does not unlock the host
tier under them."""

import threading
import time

from nccl_ext.device_path import path
from tests.nccl_ext.device_path.test_device_path import _dp, _Recording


def test_close_returns_within_its_bound_naming_a_stuck_thread_and_stuck_copies(monkeypatch, capsys):
    monkeypatch.setattr(path, "CLOSE_S", 0.3)
    stuck = threading.Event()
    dp = _dp(_Recording(5), mode="off", workers=2)
    dp._prep = threading.Thread(target=stuck.wait, args=(30,), name="prism-prefetch-plan-0", daemon=True)
    dp._prep.start()
    copies = threading.Thread(target=dp._parallel, args=([(1,), (2,)], lambda _: stuck.wait(30)), daemon=True)
    copies.start()
    time.sleep(0.05)
    unpinned = []
    monkeypatch.setattr(dp, "_unpin_tier", lambda: unpinned.append(True))
    t0 = time.monotonic()
    assert dp.close() == (5, 0)
    assert time.monotonic() - t0 < 2.0
    err = capsys.readouterr().err
    assert "close waited 0.3 s and left prism-prefetch-plan-0 (planning), 2 copies or sums on the helper threads" in err
    assert not unpinned  # a copy may still read the tier
    stuck.set()


def test_close_of_a_path_whose_threads_end_unlocks_the_tier(monkeypatch, capsys):
    dp = _dp(_Recording(3), mode="off", workers=2)
    assert dp._parallel([(1,), (2,)], lambda x: x * 2) == [2, 4]
    unpinned = []
    monkeypatch.setattr(dp, "_unpin_tier", lambda: unpinned.append(True))
    dp.close()
    assert unpinned == [True] and "left" not in capsys.readouterr().err
