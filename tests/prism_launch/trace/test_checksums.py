import pytest

from prism_launch.trace import TraceCorruptError, TraceReader, TraceLayout, tensor_blob_name
from tests.prism_launch.trace.sample_trace import write_sample


@pytest.mark.parametrize("target", ["events.parquet", "tensor"])
def test_flipped_byte_is_detected(tmp_path, target):
    path = tmp_path / "trace"
    write_sample(path)
    rel = "events.parquet" if target == "events.parquet" else tensor_blob_name(0)
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


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files hashed from now on."""
    from prism_launch.trace import checksums

    names: list[str] = []
    real = checksums.sha256_file
    monkeypatch.setattr(checksums, "sha256_file", lambda p: names.append(p.name) or real(p))
    return names


def test_files_found_intact_are_not_hashed_again_until_they_change(tmp_path, hashed):
    path = tmp_path / "trace"
    m, _ = write_sample(path)
    hashed.clear()  # what the writer hashed
    TraceReader(path)
    assert hashed == []  # the writer hashed what it wrote and remembered it
    TraceLayout(path).verified.unlink()
    TraceReader(path)
    assert len(hashed) == len(m.files)  # nothing remembered: everything hashed
    hashed.clear()
    TraceReader(path)
    assert hashed == []  # nothing changed since
    f = path / tensor_blob_name(0)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))  # same size, new modification time
    with pytest.raises(TraceCorruptError) as ei:
        TraceReader(path)
    assert hashed == [f.name] and ei.value.file == tensor_blob_name(0)
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))  # repaired: hashed once more, then remembered again
    TraceReader(path)
    hashed.clear()
    TraceReader(path)
    assert hashed == []


def test_a_trace_that_cannot_be_written_is_verified_at_every_open(tmp_path, hashed, monkeypatch):
    from nccl_ext.core import atomic

    path = tmp_path / "trace"
    m, _ = write_sample(path)
    hashed.clear()
    verified = TraceLayout(path).verified
    verified.unlink()
    monkeypatch.setattr(atomic.os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError("read-only")))
    for _ in range(2):
        TraceReader(path)
    assert len(hashed) == 2 * len(m.files)
    assert not verified.exists() and not list(path.glob("*.tmp"))
