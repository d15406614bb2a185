"""A full exact capture (``capture.payload=full``) of the bundled dense recipe streamed in small
spill files (``capture.spill_mib`` far below one step's tensors): the launcher never holds more than a spill file's tensors,
identical tensors are stored once, and emulation from the streamed, deduplicated trace is
bit-identical to the capture, on the host and the device data path."""

import json

import pytest

from prism_launch.trace import TraceReader
from tests.conftest import EXAMPLES, logged_metrics, rank_lines, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
DENSE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
SPILL_MIB = 0.5


def _flags(nproc: int) -> list:
    return ["--nproc-per-node", str(nproc), "-r", "3", "device=cpu", "comm.timeout_s=120"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    d = tmp_path_factory.mktemp("streamed")
    r = run_prism([*_flags(8), "--log-dir", d / "logs", "mode=capture", f"trace.dir={d / 'trace'}",
                   "capture.payload=full", f"capture.spill_mib={SPILL_MIB}", RECIPE, *DENSE, "--log-all-ranks"],
                  cwd=d, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return d


def test_the_capture_streamed_its_tensors_and_stored_identical_ones_once(streamed):
    trace = TraceReader(streamed / "trace")
    stats = trace.read_json("capture.json")
    blobs = [f for f in trace.manifest.files if f.startswith("tensors/blob")]
    assert len(blobs) >= stats["tensor_bytes"] / (SPILL_MIB * 2**20) * 0.5
    largest_op = max(e["nbytes"] for e in trace.events().to_pylist())
    assert stats["tensor_bytes_peak_pending"] <= SPILL_MIB * 2**20 + largest_op
    assert 0 < stats["tensor_bytes_stored"] < stats["tensor_bytes"]  # pipeline sends equal the receives' results
    assert stats["launcher_peak_rss_bytes"] > 0


@pytest.mark.parametrize("sandbox,data_path", [([5], "host"), ([0, 3], "host"), ([5], "device")])
def test_emulation_of_a_streamed_trace_is_bit_identical(streamed, tmp_path, sandbox, data_path):
    d = streamed
    r = run_prism([*_flags(8), "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                   f"sandbox.ranks={json.dumps(sandbox)}", f"report.dir={tmp_path / 'report'}",
                   f"emulate.data_path={data_path}", RECIPE, *DENSE, "--log-all-ranks"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    for rank in sandbox:
        emu, cap = logged_metrics(rank_lines(tmp_path / "logs", rank)), logged_metrics(rank_lines(d / "logs", rank))
        assert len(emu) >= 3 and emu == cap, (sandbox, rank)  # exact float equality
        assert report["ranks"][str(rank)]["divergences"] == []
