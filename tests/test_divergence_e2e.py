"""Divergences by kind end to end: host scalars (a configured call site's wall-clock
all-reduce) and non-deterministic float noise are reported by kind and never fail
``emulate.strict=true``; a changed value does — from a ``full`` trace (the recorded tensors) and
from an ``exact`` one, which keeps only the digest and statistics (word sum, L1 norm, max-abs)
of the sandbox rank's own contributions."""

import json

import pytest

from tests.conftest import WORKERS, run_prism

SCRIPT = WORKERS / "nondeterministic.py"
COMMON = ["--nproc-per-node", "2", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60",
          "emulate.strict=true", "sandbox.ranks=[0]", 'emulate.host_scalar_sites=["nondeterministic.py:log_times"]']


@pytest.fixture(scope="module", params=["full", "exact"])
def trace(tmp_path_factory, request):
    d = tmp_path_factory.mktemp(f"nondet-{request.param}")
    r = run_prism([*COMMON, "mode=capture", f"capture.payload={request.param}", f"trace.dir={d / 'trace'}", SCRIPT],
                  cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    return d / "trace"


@pytest.mark.parametrize("path", ["host", "device"])  # device: word sums and L1 norms, classified at the step end
def test_host_scalars_and_noise_are_reported_by_kind_and_pass_strict(trace, tmp_path, path):
    r = run_prism([*COMMON, "mode=emulate", f"emulate.data_path={path}", f"trace.dir={trace}",
                   f"report.dir={tmp_path / 'rep'}", SCRIPT], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    entry = json.loads((tmp_path / "rep" / "report.json").read_text())["ranks"]["0"]
    assert entry["divergence_counts"] == {"value": 0, "tolerance": 3, "host_scalar": 3}, entry["divergences"]
    kinds = {d["kind"] for d in entry["divergences"]}
    assert kinds == {"tolerance", "host_scalar"}
    host = next(d for d in entry["divergences"] if d["kind"] == "host_scalar")
    assert host["site"].endswith(":log_times") and host["step"] == 0
    noise = next(d for d in entry["divergences"] if d["kind"] == "tolerance")
    assert noise["op"] == "allreduce"
    if path == "host" and "max_abs_diff" in noise:  # full: against the recorded tensor
        assert 0 < noise["max_abs_diff"] < 1e-4
    elif path == "host":  # exact: against the recorded statistics
        assert 0 < noise["l1_rel_diff"] < 1e-5 and noise["max_abs_rel_diff"] < 1e-4
    else:
        assert 0 < noise["l1_rel_diff"] < 1e-5
    assert "0 (+3 within tolerance, 3 host scalars)" in " ".join(r.stderr.split())


def test_a_changed_value_fails_strict(trace, tmp_path):
    r = run_prism([*COMMON, "mode=emulate", f"trace.dir={trace}", f"report.dir={tmp_path / 'rep'}", SCRIPT],
                  cwd=tmp_path, env={"DIVERGE": "1"})
    assert r.returncode != 0
    assert "divergence (value) on rank 0 at step 2" in r.stderr and "emulate.strict=true" in r.stderr
