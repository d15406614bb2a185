import os
import time

import pytest
import torch

from prism_launch.trace import TraceMissingError, TraceReader, cleanup_stale_partials
from tests.prism_launch.trace.sample_trace import leftovers, write_sample


@pytest.mark.parametrize("exchange", [True, False])
def test_overwrite_existing_trace_atomically(tmp_path, monkeypatch, exchange):
    import prism_launch.trace.durable as durable

    if not exchange:  # file systems without an atomic swap: rename aside, rename in
        monkeypatch.setattr(durable, "_rename_exchange", lambda a, b: False)
    path = tmp_path / "trace"
    write_sample(path, extra={"gen": 1})
    old_ino = path.stat().st_ino
    write_sample(path, extra={"gen": 2}, tensors={"ar/1": torch.ones(2, 3), "only": torch.ones(1)})
    assert path.stat().st_ino != old_ino
    r = TraceReader(path)
    assert r.manifest.extra == {"gen": 2}
    assert r.has_tensor(0, "only") and not r.has_tensor(0, "ids")
    assert leftovers(tmp_path) == []


def test_staging_dir_is_not_a_trace_and_is_cleaned(tmp_path):
    stale = tmp_path / ".trace.partial-123-deadbeef"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")
    with pytest.raises(TraceMissingError):
        TraceReader(stale)
    fresh = tmp_path / ".other.partial-9-abcd"
    fresh.mkdir()
    old = time.time() - 7200
    os.utime(stale, (old, old))
    assert cleanup_stale_partials(tmp_path) == [stale]
    assert not stale.exists() and fresh.exists()
