import pyarrow as pa
import pytest
import torch

from prism_launch.trace import TraceError, TraceReader, TraceWriter
from tests.prism_launch.trace.sample_trace import COMMIT_KW, leftovers, sample_events, sample_tensors, write_sample


def test_events_as_table_and_many_batches(tmp_path):
    tbl = pa.table({"rank": pa.array([1, 1], pa.int32()), "idx": [5, 4], "kind": ["marker"] * 2, "op": ["a", "b"]})
    with TraceWriter(tmp_path / "t") as w:
        w.add_events(tbl)
        w.add_events([{"rank": 0, "idx": i, "kind": "marker", "op": "m"} for i in range(10, 0, -1)])
        w.commit(**COMMIT_KW)
    r = TraceReader(tmp_path / "t")
    assert [e["idx"] for e in r.events_for_rank(0)] == list(range(1, 11))
    assert [e["op"] for e in r.events_for_rank(1)] == ["b", "a"]
    assert r.events_for_rank(1)[0]["tensor_key"] is None


def test_exception_inside_with_leaves_nothing(tmp_path):
    path = tmp_path / "trace"
    with pytest.raises(RuntimeError, match="boom"):
        with TraceWriter(path) as w:
            w.add_events(sample_events())
            w.add_tensors(0, sample_tensors())
            w.write_json("a.json", [1])
            raise RuntimeError("boom")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []
    w.abort()  # idempotent


def test_failed_commit_keeps_old_trace(tmp_path, monkeypatch):
    path = tmp_path / "trace"
    write_sample(path, extra={"gen": 1})
    import prism_launch.trace.spill as spill

    def broken_save(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(spill, "safetensors_parts", broken_save)
    with pytest.raises(OSError, match="disk full"):
        write_sample(path, extra={"gen": 2})
    assert TraceReader(path).manifest.extra == {"gen": 1}
    assert leftovers(tmp_path) == []


def test_invalid_inputs(tmp_path):
    with TraceWriter(tmp_path / "t") as w:
        with pytest.raises(ValueError, match="required"):
            w.add_events([{"rank": 0, "kind": "marker", "op": "x"}])
        with pytest.raises(ValueError, match="kind"):
            w.add_events([{"rank": 0, "idx": 0, "kind": "bogus", "op": "x"}])
        with pytest.raises(ValueError, match="unknown"):
            w.add_events([{"rank": 0, "idx": 0, "kind": "marker", "op": "x", "typo": 1}])
        with pytest.raises(ValueError):
            w.write_json("../escape.json", {})
        with pytest.raises(ValueError):
            w.write_json("manifest.json", {})
        w.add_events([{"rank": 0, "idx": 0, "kind": "marker", "op": "x"}] * 2)
        with pytest.raises(ValueError, match="duplicate event"):
            w.commit(**COMMIT_KW)
        w.abort()
    assert not (tmp_path / "t").exists()

    with TraceWriter(tmp_path / "u") as w:
        w.add_events([{"rank": 3, "idx": 0, "kind": "marker", "op": "x"}])
        with pytest.raises(ValueError, match="ranks_captured"):
            w.commit(**COMMIT_KW)
        w.add_events([{"rank": 0, "idx": 0, "kind": "p2p", "op": "recv", "tensor_key": "missing"}])
        with pytest.raises(ValueError, match="missing"):
            w.commit(**{**COMMIT_KW, "ranks_captured": [0, 3]})
        w.add_tensors(0, {"missing": torch.ones(1)})
        w.commit(**{**COMMIT_KW, "ranks_captured": [0, 3]})


def test_refuses_to_replace_foreign_directory(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    with pytest.raises(TraceError, match="not a PrismTrace"):
        TraceWriter(d)
    assert (d / "precious.txt").read_text() == "keep me"
