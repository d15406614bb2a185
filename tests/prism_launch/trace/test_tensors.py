import sys

import pytest
import torch

from prism_launch.trace import TraceKeyError, TraceReader, TraceWriter, tensor_blob_name
from tests.prism_launch.trace.sample_trace import COMMIT_KW, write_sample


def test_tensors_are_snapshotted_and_merged(tmp_path):
    t = torch.zeros(3)
    with TraceWriter(tmp_path / "t") as w:
        w.add_tensors(0, {"a": t})
        t += 1  # later in-place change by the caller must not leak into the trace
        w.add_tensors(0, {"b": torch.ones(2)})
        w.commit(**COMMIT_KW)
    r = TraceReader(tmp_path / "t")
    assert torch.equal(r.tensor(0, "a"), torch.zeros(3))
    assert torch.equal(r.tensor(0, "b"), torch.ones(2))


def test_duplicate_tensor_key(tmp_path):
    with TraceWriter(tmp_path / "t") as w:
        w.add_tensors(0, {"a": torch.ones(1)})
        with pytest.raises(ValueError, match="'a'"):
            w.add_tensors(0, {"b": torch.ones(1), "a": torch.zeros(1)})
        w.add_tensors(1, {"a": torch.ones(1)})  # other rank is fine
        w.commit(**COMMIT_KW)
    assert not TraceReader(tmp_path / "t").has_tensor(0, "b")


def test_views_map_the_file_copy_on_write(tmp_path):
    path = tmp_path / "trace"
    _, tensors = write_sample(path)
    r = TraceReader(path)
    for key, t in tensors.items():
        v = r.tensor_view(0, key)
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
        assert r.tensor_meta(0, key) == (tuple(t.shape), t.dtype)
    with pytest.raises(TraceKeyError, match="nope"):
        r.tensor_meta(0, "nope")
    with pytest.raises(TraceKeyError, match="no tensors"):
        r.tensor_view(1, "ids")
    v = r.tensor_view(0, "ids")
    if sys.platform.startswith("linux"):  # no copy: the view's bytes lie in a private mapping of the file
        spans = [line.split() for line in open("/proc/self/maps")]
        assert any(
            s[-1] == str(path / tensor_blob_name(0)) and "p" in s[1]
            and int(s[0].split("-")[0], 16) <= v.data_ptr() < int(s[0].split("-")[1], 16)
            for s in spans if len(s) >= 6
        )
    v += 1  # changes the process's pages, never the trace
    assert torch.equal(TraceReader(path).tensor(0, "ids"), tensors["ids"])
