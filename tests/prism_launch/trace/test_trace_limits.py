"""A trace read back is checked before anything of it is allocated: its folders and files are
the reader's own and writable by no one else, each tensor header adds up (numel × itemsize =
stored bytes), and the events file's footer matches what the manifest recorded."""

import json
import os
import struct

import pyarrow.parquet as pq
import pytest

from prism_launch.trace import TraceCorruptError, TraceReader
from prism_launch.trace.checksums import sha256_file
from prism_launch.trace.signing import TraceUnsafeError
from prism_launch.trace.tensors import TensorFile, check_header
from tests.prism_launch.trace.sample_trace import write_sample


@pytest.fixture(autouse=True)
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _reseal(root, rel):
    """Record a changed file's sum in the manifest, as a hostile author would."""
    m = json.loads((root / "manifest.json").read_text())
    m["files"][rel] = sha256_file(root / rel)
    (root / "manifest.json").write_text(json.dumps(m))


def _tensor_file(root):
    return next(rel for rel in json.loads((root / "manifest.json").read_text())["files"] if rel.endswith(".safetensors"))


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])  # offsets count from the data


def test_a_tensor_header_claiming_more_elements_than_stored_is_refused_before_allocation(tmp_path, monkeypatch):
    write_sample(tmp_path / "t")
    rel = _tensor_file(tmp_path / "t")

    def grow(header):
        name = next(k for k, v in header.items() if k != "__metadata__" and v["shape"] == [5])
        header[name]["shape"] = [1 << 40]  # 8 TiB of int64 behind 40 stored bytes

    _rewrite_header(tmp_path / "t" / rel, grow)
    _reseal(tmp_path / "t", rel)
    opened = []
    import prism_launch.trace.tensors as tensors

    monkeypatch.setattr(tensors, "safe_open", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match=r"shape \[1099511627776\] of I64 is 8796093022208 bytes, but 40 are stored"):
        check_header(tmp_path / "t" / rel)
    reader = TraceReader(tmp_path / "t")
    with pytest.raises(TraceCorruptError, match="but 40 are stored"):
        reader.tensor(0, "ids")
    assert opened == []  # refused before the library mapped or allocated anything


def test_data_offsets_outside_the_file_are_refused(tmp_path):
    write_sample(tmp_path / "t")
    path = tmp_path / "t" / _tensor_file(tmp_path / "t")

    def past_end(header):
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [0, 1 << 30]

    _rewrite_header(path, past_end)
    with pytest.raises(ValueError, match="lie outside the file"):
        TensorFile(path)


def test_an_intact_tensor_file_passes(tmp_path):
    _, tensors = write_sample(tmp_path / "t")
    reader = TraceReader(tmp_path / "t")
    assert reader.tensor(0, "ids").tolist() == tensors["ids"].tolist()


def test_an_events_footer_other_than_the_manifest_recorded_is_refused_unread(tmp_path, monkeypatch):
    write_sample(tmp_path / "t")
    root = tmp_path / "t"
    table = pq.read_table(root / "events.parquet")
    pq.write_table(table.slice(0, 2), root / "events.parquet")
    _reseal(root, "events.parquet")
    read = []
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: read.append(a))
    with pytest.raises(TraceCorruptError, match="its footer says 2 rows, the manifest recorded 3"):
        TraceReader(root).events()
    assert read == []


def test_an_events_file_larger_than_memory_is_refused_unread(tmp_path, monkeypatch):
    import prism_launch.trace.reader as reader_mod

    write_sample(tmp_path / "t")
    monkeypatch.setattr(reader_mod, "_physical_memory", lambda: 100)
    with pytest.raises(TraceCorruptError, match="more than this machine's 100 bytes of memory"):
        TraceReader(tmp_path / "t").events()


def test_the_writer_records_the_events_footer(tmp_path):
    m, _ = write_sample(tmp_path / "t")
    assert m.event_rows == 3 and m.event_bytes > 0
    assert TraceReader(tmp_path / "t").events().num_rows == 3


@pytest.mark.parametrize("where", [".", "tensors", "manifest.json", "events.parquet"])
def test_a_trace_others_can_write_is_refused(tmp_path, where):
    write_sample(tmp_path / "t")
    os.chmod(tmp_path / "t" / where, os.stat(tmp_path / "t" / where).st_mode | 0o002)
    with pytest.raises(TraceUnsafeError, match=r"is refused: .*is writable by group or others.*Copy the trace"):
        TraceReader(tmp_path / "t")


def test_a_trace_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    from prism_launch.config import private_dirs

    write_sample(tmp_path / "t")
    monkeypatch.setattr(private_dirs.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(TraceUnsafeError, match="is owned by uid"):
        TraceReader(tmp_path / "t")


def test_a_writer_under_a_permissive_umask_still_writes_a_private_trace(tmp_path):
    old = os.umask(0o000)
    try:
        write_sample(tmp_path / "t")
    finally:
        os.umask(old)
    TraceReader(tmp_path / "t").events()
