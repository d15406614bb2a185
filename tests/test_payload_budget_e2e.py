"""``capture.payload=auto`` against a nearly full disk: the budget is the free space at the
trace directory (less 10%, here below ``capture.payload_budget_gib``); a full capture that
passes it records again with the next policy (``exact``), saying why, and the trace it leaves
is the exact one. tests/workers/fake_disk makes every ``shutil.disk_usage`` report 100 MiB free."""

import json

import pytest

from tests.conftest import MOE_RECIPE, WORKERS, run_prism

FREE = 100 * 2**20


@pytest.mark.slow
def test_past_the_free_disk_auto_records_again_with_exact_and_says_why(tmp_path):
    # mode=capture (not auto): full first; 16 steps of the MoE recipe record ~140 MiB of tensors in full, ~21 exact
    r = run_prism(["--nproc-per-node", "4", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "mode=capture",
                   "sandbox.ranks=[0]", f"trace.dir={tmp_path / 'trace'}", *MOE_RECIPE, "--train-iters", "16"],
                  cwd=tmp_path, timeout=900,
                  env={"PYTHONPATH": str(WORKERS / "fake_disk"), "PRISM_FAKE_FREE_BYTES": str(FREE)})
    assert r.returncode == 0, r.stderr[-3000:]
    [said] = [ln for ln in r.stderr.splitlines() if "capture.payload=auto:" in ln]
    budget_gib = FREE * 0.9 / 2**30
    assert f"past the budget set by the free space at {tmp_path}" in said and f"({budget_gib:.2f} GiB)" in said
    assert "recording again with payload=exact (only the tensors sandbox ranks [0] consume)" in said
    manifest = json.loads((tmp_path / "trace" / "manifest.json").read_text())
    assert manifest["extra"]["payload"] == "exact" and manifest["extra"]["payload_ranks"] == [0]
    stats = manifest["extra"]["capture"]
    assert stats["tensor_bytes"] <= FREE * 0.9  # the trace it kept is within the budget
