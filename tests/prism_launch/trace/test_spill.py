"""Tensors streamed to disk as they are recorded (:mod:`prism_launch.trace.spill`): identical
tensors stored once and resolved for every (rank, key) that recorded them, the launcher's
waiting bytes bounded by ``spill_bytes``, a writer that never commits leaves nothing a reader
accepts, and format-1 traces (a file per rank) still read."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from prism_launch.trace import (
    TENSOR_INDEX_NAME,
    TraceCorruptError,
    TraceLayout,
    TraceMissingError,
    TraceReader,
    TraceWriter,
    tensor_blob_name,
    tensor_file_name,
)
from prism_launch.trace.checksums import sha256_file
from tests.prism_launch.trace.sample_trace import COMMIT_KW, leftovers, sample_events


def _events(ranks_keys):
    return [{"rank": r, "idx": i, "kind": "collective", "op": "all_reduce", "tensor_key": k}
            for r, keys in ranks_keys.items() for i, k in enumerate(keys)]


def test_identical_tensors_are_stored_once_and_every_alias_resolves(tmp_path):
    g = torch.Generator().manual_seed(0)
    shared, other = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    with TraceWriter(tmp_path / "t") as w:
        w.record_tensor(0, "c/0/1/0", shared)
        w.record_tensor(1, "c/0/1/0", shared.clone())  # equal bytes, another buffer
        w.record_tensor(1, "r/3/7/0", shared.clone())  # another key too
        w.record_tensor(0, "c/0/2/0", other)
        w.record_tensor(0, "as_int", shared.view(torch.int32).clone())  # same bytes, another dtype: its own
        stats = w.tensor_stats()
        w.add_events(_events({0: ["c/0/1/0", "c/0/2/0"], 1: ["c/0/1/0", "r/3/7/0"]}))
        w.commit(**COMMIT_KW)
    assert stats["logical_bytes"] == 5 * 4000 and stats["stored_bytes"] == 3 * 4000
    r = TraceReader(tmp_path / "t")
    assert set(r.manifest.files) >= {TENSOR_INDEX_NAME, tensor_blob_name(0)}
    for rank, key, want in [(0, "c/0/1/0", shared), (1, "c/0/1/0", shared), (1, "r/3/7/0", shared),
                            (0, "c/0/2/0", other)]:
        assert torch.equal(r.tensor(rank, key), want) and r.tensor_meta(rank, key) == ((1000,), torch.float32)
    assert r.tensor(0, "as_int").dtype == torch.int32
    assert r.tensor_keys(1) == {"c/0/1/0", "r/3/7/0"} and not r.has_tensor(1, "c/0/2/0")
    index = pq.read_table(tmp_path / "t" / TENSOR_INDEX_NAME).to_pylist()
    assert len(index) == 5 and len({(row["file"], row["name"]) for row in index}) == 3


def test_waiting_bytes_stay_under_the_spill_size_whatever_the_steps(tmp_path):
    spill = 64 << 10
    peaks = []
    for steps in (4, 32):
        with TraceWriter(tmp_path / f"t{steps}", spill_bytes=spill) as w:
            keys = {0: [], 1: []}
            for s in range(steps):
                for rank in (0, 1):
                    t = torch.full((4096,), float(s * 2 + rank))  # 16 KiB, distinct
                    w.record_tensor(rank, f"c/0/{s}/0", t)
                    keys[rank].append(f"c/0/{s}/0")
            peaks.append(w.tensor_stats()["peak_pending_bytes"])
            w.add_events(_events(keys))
            w.commit(**COMMIT_KW)
        r = TraceReader(tmp_path / f"t{steps}")
        blobs = [f for f in r.manifest.files if f.startswith("tensors/blob")]
        assert len(blobs) == -(-steps * 2 * 16 // 64)  # one file per 64 KiB recorded
        assert all(torch.equal(r.tensor(rank, f"c/0/{s}/0"), torch.full((4096,), float(s * 2 + rank)))
                   for s in range(steps) for rank in (0, 1))
    assert peaks[0] == peaks[1] == spill  # bounded, independent of the step count


def test_spill_files_are_on_disk_before_the_commit_and_sealed_with_the_written_bytes(tmp_path):
    with TraceWriter(tmp_path / "t", spill_bytes=1024) as w:
        w.record_tensor(0, "a", torch.arange(1024, dtype=torch.float32))
        spilled = w.staging_dir / tensor_blob_name(0)
        assert spilled.is_file() and w.tensor_stats()["pending_bytes"] == 0
        w.add_events(_events({0: ["a"]}))
        m = w.commit(**COMMIT_KW)
    assert m.files[tensor_blob_name(0)] == sha256_file(tmp_path / "t" / tensor_blob_name(0))
    TraceReader(tmp_path / "t", verify=True)


def test_an_interrupted_capture_leaves_nothing_a_reader_accepts(tmp_path):
    final = tmp_path / "t"
    with pytest.raises(RuntimeError, match="rank died"):
        with TraceWriter(final, spill_bytes=1024) as w:
            w.record_tensor(0, "a", torch.ones(1024))
            raise RuntimeError("rank died")
    assert not final.exists() and leftovers(tmp_path) == []
    # a killed launcher never aborts: its staging directory has spill files and no manifest
    w = TraceWriter(final, spill_bytes=1024)
    w.record_tensor(0, "a", torch.ones(1024))
    assert (w.staging_dir / tensor_blob_name(0)).is_file()
    for path in (final, w.staging_dir):
        with pytest.raises(TraceMissingError):
            TraceReader(path)
    w.abort()


def test_an_index_naming_a_tensor_the_file_lacks_is_corrupt(tmp_path):
    with TraceWriter(tmp_path / "t") as w:
        w.record_tensor(0, "a", torch.ones(3))
        w.add_events(_events({0: ["a"]}))
        w.commit(**COMMIT_KW)
    path = tmp_path / "t"
    save_file({"x": torch.ones(3)}, str(path / tensor_blob_name(0)))
    with pytest.raises(TraceCorruptError, match="which the file does not hold"):
        TraceReader(path, verify=False).tensor(0, "a")


def test_format_1_traces_still_read(tmp_path):
    """A file per rank, named ``tensors/rankNNNNNN.safetensors``, keys as recorded."""
    path = tmp_path / "t"
    with TraceWriter(path) as w:
        w.add_events(sample_events())
        w.commit(**COMMIT_KW, allow_missing_tensors=True)
    want = {"ar/1": torch.randn(2, 3), "ids": torch.arange(5)}
    (path / "tensors").mkdir()
    save_file(want, str(path / tensor_file_name(0)))
    raw = json.loads(TraceLayout(path).manifest.read_text())
    raw["format_version"] = 1
    raw["files"][tensor_file_name(0)] = sha256_file(path / tensor_file_name(0))
    TraceLayout(path).manifest.write_text(json.dumps(raw))
    r = TraceReader(path)
    assert r.manifest.format_version == 1 and r.tensor_keys(0) == set(want) and not r.tensor_keys(1)
    assert all(torch.equal(r.tensor(0, k), v) for k, v in want.items())
