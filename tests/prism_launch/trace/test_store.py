import json
import os
import pickle
import time
from pathlib import Path

import pyarrow as pa
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
    TraceVersionError,
    TraceWriter,
    cleanup_stale_partials,
    tensor_file_name,
)

COMMIT_KW = dict(
    fingerprint={"config": "c0ffee", "script": "abc123"},
    versions={"torch": torch.__version__, "prism": "0.1"},
    world_size=4,
    topology={"nodes": 1, "gpus_per_node": 4},
    groups=[
        {"id": 0, "ranks": [0, 1, 2, 3], "backend": "nccl", "desc": "world"},
        {"id": 1, "ranks": [0, 1]},
    ],
    ranks_captured=[0, 1],
)


def _events():
    return [
        {
            "rank": 0,
            "idx": 1,
            "unit": 0,
            "kind": "collective",
            "op": "all_reduce",
            "group": 0,
            "seq": 1,
            "dtype": "bfloat16",
            "shape": (2, 3),
            "nbytes": 12,
            "t_start": 1.5,
            "t_end": 1.75,
            "compute_wall_s": 0.25,
            "compute_cpu_s": 0.125,
            "tensor_key": "ar/1",
            "extra": {"async_op": True},
        },
        {"rank": 0, "idx": 0, "kind": "marker", "op": "step_begin"},
        {"rank": 1, "idx": 0, "kind": "p2p", "op": "send", "peer": 0, "shape": torch.Size([4])},
    ]


def _tensors():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "ar/1": torch.randn(2, 3).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 7, dtype=torch.float16),
        "noncontig": base.t(),
    }


def _write(path, *, events=None, tensors=None, extra=None, **kw):
    tensors = _tensors() if tensors is None else tensors
    with TraceWriter(path) as w:
        w.add_events(_events() if events is None else events)
        w.add_tensors(0, tensors)
        w.write_json("config.json", {"lr": 0.1, "layers": [1, 2]})
        m = w.commit(**{**COMMIT_KW, **kw}, extra=extra or {"note": "x"})
    return m, tensors


def _leftovers(parent: Path):
    return [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_round_trip(tmp_path):
    path = tmp_path / "trace"
    m, tensors = _write(path)
    assert isinstance(m, Manifest) and m.format_version == FORMAT_VERSION
    assert set(m.files) == {"events.parquet", tensor_file_name(0), "config.json"}
    assert _leftovers(tmp_path) == []

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


@pytest.mark.parametrize("exchange", [True, False])
def test_overwrite_existing_trace_atomically(tmp_path, monkeypatch, exchange):
    import prism_launch.trace.store as store

    if not exchange:  # file systems without an atomic swap: rename aside, rename in
        monkeypatch.setattr(store, "_rename_exchange", lambda a, b: False)
    path = tmp_path / "trace"
    _write(path, extra={"gen": 1})
    old_ino = path.stat().st_ino
    _write(path, extra={"gen": 2}, tensors={"ar/1": torch.ones(2, 3), "only": torch.ones(1)})
    assert path.stat().st_ino != old_ino
    r = TraceReader(path)
    assert r.manifest.extra == {"gen": 2}
    assert r.has_tensor(0, "only") and not r.has_tensor(0, "ids")
    assert _leftovers(tmp_path) == []


def test_exception_inside_with_leaves_nothing(tmp_path):
    path = tmp_path / "trace"
    with pytest.raises(RuntimeError, match="boom"):
        with TraceWriter(path) as w:
            w.add_events(_events())
            w.add_tensors(0, _tensors())
            w.write_json("a.json", [1])
            raise RuntimeError("boom")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []
    w.abort()  # idempotent


def test_failed_commit_keeps_old_trace(tmp_path, monkeypatch):
    path = tmp_path / "trace"
    _write(path, extra={"gen": 1})
    import prism_launch.trace.store as store

    def broken_save(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(store, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        _write(path, extra={"gen": 2})
    assert TraceReader(path).manifest.extra == {"gen": 1}
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("target", ["events.parquet", "tensor"])
def test_flipped_byte_is_detected(tmp_path, target):
    path = tmp_path / "trace"
    _write(path)
    rel = "events.parquet" if target == "events.parquet" else tensor_file_name(0)
    f = path / rel
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(TraceCorruptError) as ei:
        TraceReader(path)
    assert ei.value.file == rel
    assert rel in str(ei.value) and str(path) in str(ei.value)
    assert ei.value.expected != ei.value.actual
    TraceReader(path, verify=False)  # presence-only check still opens


@pytest.mark.parametrize("rel", ["events.parquet", "tensors/rank000000.safetensors", "config.json"])
def test_deleted_file_is_detected(tmp_path, rel):
    path = tmp_path / "trace"
    _write(path)
    (path / rel).unlink()
    for verify in (True, False):
        with pytest.raises(TraceCorruptError, match=rel.split("/")[-1]):
            TraceReader(path, verify=verify)


def test_unreadable_manifest(tmp_path):
    path = tmp_path / "trace"
    _write(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(TraceCorruptError, match="manifest.json"):
        TraceReader(path)


def test_wrong_format_version(tmp_path):
    path = tmp_path / "trace"
    _write(path)
    mp = path / "manifest.json"
    raw = json.loads(mp.read_text())
    raw["format_version"] = FORMAT_VERSION + 1
    mp.write_text(json.dumps(raw))
    with pytest.raises(TraceVersionError, match=str(FORMAT_VERSION + 1)):
        TraceReader(path)


def test_missing_trace_mentions_hint(tmp_path):
    hint = "prism-launch --nproc-per-node 8 train.py mode=capture trace=/x"
    with pytest.raises(TraceMissingError) as ei:
        TraceReader(tmp_path / "nope", hint=hint)
    assert hint in str(ei.value) and "nope" in str(ei.value)
    with pytest.raises(TraceMissingError, match="mode=capture"):
        TraceReader(tmp_path)  # exists but has no manifest
    err = pickle.loads(pickle.dumps(ei.value))
    assert isinstance(err, TraceError) and str(err) == str(ei.value)


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


def test_duplicate_tensor_key(tmp_path):
    with TraceWriter(tmp_path / "t") as w:
        w.add_tensors(0, {"a": torch.ones(1)})
        with pytest.raises(ValueError, match="'a'"):
            w.add_tensors(0, {"b": torch.ones(1), "a": torch.zeros(1)})
        w.add_tensors(1, {"a": torch.ones(1)})  # other rank is fine
        w.commit(**COMMIT_KW)
    assert not TraceReader(tmp_path / "t").has_tensor(0, "b")


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


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files hashed from now on."""
    from prism_launch.trace import store

    names: list[str] = []
    real = store._sha256_file
    monkeypatch.setattr(store, "_sha256_file", lambda p: names.append(p.name) or real(p))
    return names


def test_files_found_intact_are_not_hashed_again_until_they_change(tmp_path, hashed):
    from prism_launch.trace import store

    path = tmp_path / "trace"
    m, _ = _write(path)
    hashed.clear()  # what the writer hashed
    TraceReader(path)
    assert hashed == []  # the writer hashed what it wrote and remembered it
    (path / store.VERIFIED_NAME).unlink()
    TraceReader(path)
    assert len(hashed) == len(m.files)  # nothing remembered: everything hashed
    hashed.clear()
    TraceReader(path)
    assert hashed == []  # nothing changed since
    f = path / tensor_file_name(0)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))  # same size, new modification time
    with pytest.raises(TraceCorruptError) as ei:
        TraceReader(path)
    assert hashed == [f.name] and ei.value.file == tensor_file_name(0)
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))  # repaired: hashed once more, then remembered again
    TraceReader(path)
    hashed.clear()
    TraceReader(path)
    assert hashed == []


def test_a_trace_that_cannot_be_written_is_verified_at_every_open(tmp_path, hashed, monkeypatch):
    from prism_launch.trace import store

    path = tmp_path / "trace"
    m, _ = _write(path)
    hashed.clear()
    (path / store.VERIFIED_NAME).unlink()
    monkeypatch.setattr(store.os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError("read-only")))
    for _ in range(2):
        TraceReader(path)
    assert len(hashed) == 2 * len(m.files)
    assert not (path / store.VERIFIED_NAME).exists() and not list(path.glob("*.tmp"))
