"""``capture.payload=exact`` is scoped to the sandbox ranks named at capture: the trace stores
only the tensors they consume (virtual peers' contributions to their groups, sends to them,
their folded results), and of their own data a digest and statistics. On the bundled dense
recipe, folded (16 ranks, TP2·PP2·DP4, 4 captured around sandbox rank 11), emulation is
bit-identical to the capture on the host and the device data path; the trace is a fraction of
the ``full`` one; another sandbox set is refused (``mode=auto`` captures again)."""

import json
import shutil

import pytest

from prism_launch.trace import TraceReader
from tests.conftest import EXAMPLES, capture_each, logged_metrics, rank_lines, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
DENSE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--replicate-data",
         "--log-all-ranks"]
BASE = ["--nnodes", "2", "--nproc-per-node", "8", "-r", "3", "device=cpu", "comm.timeout_s=120", "capture.fold=true"]
SANDBOX = 11


def _tensor_bytes(trace) -> int:
    return json.loads((trace / "manifest.json").read_text())["extra"]["capture"]["tensor_bytes"]


def _disk_bytes(trace) -> int:
    return sum(p.stat().st_size for p in trace.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return capture_each(tmp_path_factory, "scoped", BASE, {p: f"capture.payload={p}" for p in ("full", "exact")},
                        SANDBOX, [RECIPE, *DENSE])


def test_the_exact_trace_covers_its_sandbox_ranks_and_is_a_fraction_of_the_full_one(traces):
    full, exact = traces["full"] / "trace", traces["exact"] / "trace"
    manifest = json.loads((exact / "manifest.json").read_text())
    assert manifest["extra"]["payload"] == "exact" and manifest["extra"]["payload_ranks"] == [SANDBOX]
    assert json.loads((full / "manifest.json").read_text())["extra"]["payload_ranks"] is None
    # every captured rank computes its folded (data-parallel) collectives itself: of a virtual
    # rank's nothing is kept, of the sandbox's the digest and result come through the exchange
    mirrored = {}
    for row in TraceReader(exact).events().to_pylist():
        if row["extra"] and json.loads(row["extra"]).get("mirrored"):
            mirrored[row["rank"]] = mirrored.get(row["rank"], 0) + 1
    captured = manifest["ranks_captured"]
    assert sorted(mirrored) == sorted(captured), (mirrored, captured)
    keys = TraceReader(exact).tensor_keys(SANDBOX)
    assert keys and all(k.startswith("r/") for k in keys)  # its own contributions: statistics only
    t_full, t_exact = _tensor_bytes(full), _tensor_bytes(exact)
    d_full, d_exact = _disk_bytes(full), _disk_bytes(exact)
    print(f"tensor bytes full {t_full} exact {t_exact} ({t_exact / t_full:.3f}); "
          f"on disk full {d_full} exact {d_exact} ({d_exact / d_full:.3f})")
    # Of 4 captured ranks, sandbox 11 consumes its tensor-parallel peer's contributions, one of
    # the two pipeline directions' sends, its embedding-group peer's and its own folded
    # data-parallel results: about a fifth of what the full trace records (the GPU job's mix).
    assert t_exact <= t_full / 4, (t_exact, t_full)
    assert d_exact <= d_full / 3, (d_exact, d_full)


@pytest.mark.parametrize("data_path", ["host", "device"])
def test_emulation_of_the_exact_trace_is_bit_identical(traces, tmp_path, data_path):
    d = traces["exact"]
    r = run_prism([*BASE, "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                   f"sandbox.ranks=[{SANDBOX}]", f"emulate.data_path={data_path}", "emulate.strict=true",
                   f"report.dir={tmp_path / 'report'}", RECIPE, *DENSE], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    emu = logged_metrics(rank_lines(tmp_path / "logs", SANDBOX))
    assert len(emu) >= 3 and emu == logged_metrics(rank_lines(d / "logs", SANDBOX))  # exact float equality
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    entry = report["ranks"][str(SANDBOX)]
    assert entry["divergences"] == [], entry["divergences"]
    assert report["payload"] == {"policy": "exact", "sandbox_ranks": [SANDBOX]}


def test_another_sandbox_set_is_refused_and_auto_captures_again(traces, tmp_path):
    d = traces["exact"]
    r = run_prism([*BASE, "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                   "sandbox.ranks=[10]", f"report.dir={tmp_path / 'report'}", RECIPE, *DENSE], cwd=tmp_path,
                  timeout=600)
    assert r.returncode != 0
    err = " ".join(r.stderr.split())
    assert f"capture.payload=exact for sandbox ranks [{SANDBOX}]" in err and "sandbox ranks [10]" in err, err[-2000:]
    assert "sandbox.ranks=[10]" in err and "capture.payload=full" in err
    trace = tmp_path / "trace"
    shutil.copytree(d / "trace", trace)
    r = run_prism([*BASE, "--log-dir", tmp_path / "auto", "mode=auto", "capture.payload=exact", f"trace.dir={trace}",
                   "sandbox.ranks=[10]", f"report.dir={tmp_path / 'report'}", RECIPE, *DENSE], cwd=tmp_path,
                  timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "capturing again for sandbox ranks [10]" in r.stderr
    assert json.loads((trace / "manifest.json").read_text())["extra"]["payload_ranks"] == [10]
