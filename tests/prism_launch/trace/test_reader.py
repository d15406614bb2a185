import json
import pickle

import pytest
import torch

from prism_launch.trace import (
    EVENT_SCHEMA,
    FORMAT_VERSION,
    Manifest,
    TraceCorruptError,
    TraceError,
    TraceKeyError,
    TraceMissingError,
    TraceReader,
    TENSOR_INDEX_NAME,
    tensor_blob_name,
)
from tests.prism_launch.trace.sample_trace import leftovers, write_sample


def test_round_trip(tmp_path):
    path = tmp_path / "trace"
    m, tensors = write_sample(path)
    assert isinstance(m, Manifest) and m.format_version == FORMAT_VERSION
    assert set(m.files) == {"events.parquet", tensor_blob_name(0), TENSOR_INDEX_NAME, "config.json"}
    assert leftovers(tmp_path) == []

    r = TraceReader(path)
    assert r.manifest == m
    assert r.manifest.groups[1] == {"id": 1, "ranks": [0, 1], "backend": "", "desc": ""}
    assert r.manifest.extra == {"note": "x"}

    table = r.events()
    assert table.schema.equals(EVENT_SCHEMA)
    assert table.num_rows == 3

    ev0 = r.events_for_rank(0)
    assert [e["idx"] for e in ev0] == [0, 1]
    marker, ar = ev0
    assert marker["tensor_key"] is None and marker["extra"] is None
    assert marker["group"] == -1 and marker["seq"] == -1 and marker["peer"] == -1
    assert marker["shape"] == [] and marker["dtype"] == "" and marker["nbytes"] == 0
    assert ar["shape"] == [2, 3] and ar["tensor_key"] == "ar/1" and ar["t_end"] == 1.75
    assert json.loads(ar["extra"]) == {"async_op": True}
    ev1 = r.events_for_rank(1)
    assert ev1[0]["op"] == "send" and ev1[0]["peer"] == 0 and ev1[0]["shape"] == [4]
    assert r.events_for_rank(3) == []

    for key, t in tensors.items():
        assert r.has_tensor(0, key)
        got = r.tensor(0, key)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t)
    assert r.tensor(0, "empty").numel() == 0
    assert not r.has_tensor(0, "nope") and not r.has_tensor(1, "ar/1")
    with pytest.raises(KeyError, match="nope"):
        r.tensor(0, "nope")
    with pytest.raises(TraceKeyError, match="no tensors"):
        r.tensor(1, "x")

    assert r.read_json("config.json") == {"lr": 0.1, "layers": [1, 2]}
    with pytest.raises(KeyError):
        r.read_json("other.json")
    r.close()


@pytest.mark.parametrize("rel", ["events.parquet", "tensors/blob000000.safetensors", "tensors/index.parquet", "config.json"])
def test_deleted_file_is_detected(tmp_path, rel):
    path = tmp_path / "trace"
    write_sample(path)
    (path / rel).unlink()
    for verify in (True, False):
        with pytest.raises(TraceCorruptError, match=rel.split("/")[-1]):
            TraceReader(path, verify=verify)


def test_missing_trace_mentions_hint(tmp_path):
    hint = "prism-launch --nproc-per-node 8 train.py mode=capture trace=/x"
    with pytest.raises(TraceMissingError) as ei:
        TraceReader(tmp_path / "nope", hint=hint)
    assert hint in str(ei.value) and "nope" in str(ei.value)
    with pytest.raises(TraceMissingError, match="mode=capture"):
        TraceReader(tmp_path)  # exists but has no manifest
    err = pickle.loads(pickle.dumps(ei.value))
    assert isinstance(err, TraceError) and str(err) == str(ei.value)
