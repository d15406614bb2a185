import json

import pytest

from prism_launch.trace import FORMAT_VERSION, TraceCorruptError, TraceReader, TraceVersionError
from tests.prism_launch.trace.sample_trace import write_sample


def test_unreadable_manifest(tmp_path):
    path = tmp_path / "trace"
    write_sample(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(TraceCorruptError, match="manifest.json"):
        TraceReader(path)


def test_wrong_format_version(tmp_path):
    path = tmp_path / "trace"
    write_sample(path)
    mp = path / "manifest.json"
    raw = json.loads(mp.read_text())
    raw["format_version"] = FORMAT_VERSION + 1
    mp.write_text(json.dumps(raw))
    with pytest.raises(TraceVersionError, match=str(FORMAT_VERSION + 1)):
        TraceReader(path)
