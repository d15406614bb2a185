"""A spill file's sha256 runs beside its write (prism_launch/trace/spill.py); the wait for it
is bounded, and a hash that does not end (or fails) is said, naming the spill file."""

import time

import pytest
import torch

from prism_launch.trace import spill
from prism_launch.trace.errors import TraceError
from prism_launch.trace.spill import SpillHashError, TensorSpill


def test_a_hash_that_does_not_end_fails_the_flush_within_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "HASH_FLOOR_S", 0.3)
    monkeypatch.setattr(spill._Hashing, "_run", lambda self: time.sleep(10))
    store = TensorSpill(tmp_path / "staging")
    store.put(0, "k", torch.ones(8))
    t0 = time.monotonic()
    with pytest.raises(SpillHashError, match=r"sha256 of spill file tensors/.* did not finish within 0.3 s") as e:
        store.flush()
    assert time.monotonic() - t0 < 3.0 and isinstance(e.value, TraceError)


def test_a_hash_that_fails_is_said_not_recorded_as_the_files_sum(tmp_path, monkeypatch):
    def broken(self):
        self.error = MemoryError("no room for the hash")
    monkeypatch.setattr(spill._Hashing, "_run", broken)
    store = TensorSpill(tmp_path / "staging")
    store.put(0, "k", torch.ones(8))
    with pytest.raises(SpillHashError, match="taking the sha256 of spill file .* failed: no room"):
        store.flush()
    assert store.sums == {}


def test_the_sum_is_the_files_own(tmp_path):
    import hashlib

    store = TensorSpill(tmp_path / "staging")
    store.put(0, "k", torch.arange(1000.0))
    store.flush()
    (rel, digest), = store.sums.items()
    assert digest == hashlib.sha256((tmp_path / "staging" / rel).read_bytes()).hexdigest()
