"""``capture.payload``: a ``none`` trace of the bundled Megatron-core recipes holds the exact
trace's op sequence, shapes and memory peaks in a few KiB per rank-step, with no tensor data;
emulation from it is bit-identical to its own capture (results synthesized alike in both);
``auto`` switches to ``none`` when an exact trace would pass its budget, and says why."""

import json
import math

import pyarrow.parquet as pq
import pytest

from tests.conftest import EXAMPLES, logged_metrics, rank_lines, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
DENSE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
       "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--moe-aux-loss-coeff", "0.01"]
STEPS = 3


def _flags(nproc: int) -> list:
    return ["--nproc-per-node", str(nproc), "-r", "3", "device=cpu", "comm.timeout_s=120"]


def _capture(d, nproc, args, payload, *extra):
    r = run_prism([*_flags(nproc), "--log-dir", d / "logs", "mode=capture", f"trace.dir={d / 'trace'}",
                   f"capture.payload={payload}", *extra, RECIPE, *args, "--log-all-ranks"], cwd=d, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def _events(trace):
    """Every rank's events with groups by key (ids follow the order groups first reached the
    coordinator, which concurrent ranks make arbitrary)."""
    keys = {g["id"]: g["key"] for g in json.loads((trace / "manifest.json").read_text())["groups"]}
    rows = pq.read_table(trace / "events.parquet").to_pylist()
    return [(r["rank"], r["idx"], r["unit"], r["kind"], r["op"], keys.get(r["group"]), r["seq"], r["peer"],
             r["dtype"], tuple(r["shape"]), r["nbytes"]) for r in rows]


def _trace_bytes(trace) -> int:
    return sum(p.stat().st_size for p in trace.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    out = {}
    for payload in ("none", "full"):
        d = tmp_path_factory.mktemp(f"dense-{payload}")
        _capture(d, 8, DENSE, payload)
        out[payload] = d
    return out


def test_none_trace_has_the_exact_traces_ops_shapes_and_peaks(dense):
    none, exact = dense["none"] / "trace", dense["full"] / "trace"
    assert _events(none) == _events(exact)
    peaks = {r: m["peak_bytes"] for r, m in json.loads((none / "memory.json").read_text()).items()}
    assert peaks == {r: m["peak_bytes"] for r, m in json.loads((exact / "memory.json").read_text()).items()}
    assert all(p > 0 for p in peaks.values())
    assert json.loads((none / "manifest.json").read_text())["extra"]["payload"] == "none"
    per_rank_step = _trace_bytes(none) / (8 * STEPS)
    assert per_rank_step <= 64 * 1024, per_rank_step
    assert _trace_bytes(exact) > 20 * _trace_bytes(none)
    for rank in range(8):  # synthesized values keep training finite
        metrics = logged_metrics(rank_lines(dense["none"] / "logs", rank))
        assert len(metrics) >= STEPS
        assert all(math.isfinite(v) for m in metrics for k, v in m.items() if k != "head"), (rank, metrics)


@pytest.mark.parametrize("sandbox", [[5], [0, 3]])
def test_emulation_of_a_none_trace_is_bit_identical_to_its_capture(dense, tmp_path, sandbox):
    d = dense["none"]
    r = run_prism([*_flags(8), "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                   f"sandbox.ranks={json.dumps(sandbox)}", f"report.dir={tmp_path / 'report'}", RECIPE, *DENSE,
                   "--log-all-ranks"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["payload"]["policy"] == "none" and "synthesized" in report["payload"]
    for rank in sandbox:
        emu = logged_metrics(rank_lines(tmp_path / "logs", rank))
        assert len(emu) >= STEPS
        assert emu == logged_metrics(rank_lines(d / "logs", rank))  # exact float equality
        entry = report["ranks"][str(rank)]
        assert entry["divergences"] == [] and entry["synthesized"] > 10
        assert entry["peak_memory_bytes"] > 0
    assert report["assistant"] is None  # nothing recorded to serve
    assert "results synthesized" in r.stdout + r.stderr


def test_moe_none_capture_keeps_the_op_sequence_and_replays_bit_identically(tmp_path):
    none, exact = tmp_path / "none", tmp_path / "exact"
    none.mkdir(), exact.mkdir()
    _capture(none, 4, MOE, "none")
    _capture(exact, 4, MOE, "exact")
    ops = lambda t: [e[:8] for e in _events(t)]  # noqa: E731 - shapes follow the synthesized routing
    assert ops(none / "trace") == ops(exact / "trace")
    r = run_prism([*_flags(4), "--log-dir", tmp_path / "emu", "mode=emulate", f"trace.dir={none / 'trace'}",
                   "sandbox.ranks=[1]", f"report.dir={tmp_path / 'report'}", RECIPE, *MOE, "--log-all-ranks"],
                  cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    emu = logged_metrics(rank_lines(tmp_path / "emu", 1))
    assert len(emu) >= STEPS and emu == logged_metrics(rank_lines(none / "logs", 1))
    assert all(math.isfinite(v) for m in emu for k, v in m.items() if k != "head")


def test_auto_payload_switches_to_none_past_its_budget(tmp_path):
    r = _capture(tmp_path, 8, DENSE, "auto", "capture.payload_budget_gib=0.001")
    assert "capture.payload=auto" in r.stderr and "recording again with payload=none" in r.stderr, r.stderr[-3000:]
    assert "capture.payload_budget_gib=0.001" in r.stderr
    manifest = json.loads((tmp_path / "trace" / "manifest.json").read_text())
    assert manifest["extra"]["payload"] == "none"
    big = tmp_path / "big"
    big.mkdir()
    r = _capture(big, 8, DENSE, "auto")
    # mode=capture: the full exact trace first (later runs may emulate any sandbox set or calibrate)
    assert json.loads((big / "trace" / "manifest.json").read_text())["extra"]["payload"] == "full"
