"""A real MoE run's ``moe`` section: the bundled Megatron-core recipe as PP2·EP2 (conftest's
MOE_RECIPE) captured with every tensor, emulated, and its routing statistics checked against
what the recipe routes by construction; ``python -m prism_launch.report.moe_stats TRACE_DIR``
prints the same section for the trace alone. Under the default ``mode=auto`` (an exact trace,
which lacks other ranks' token counts) the section says why there are no statistics."""

import json
import subprocess
import sys

import pytest

from tests.conftest import MOE_RECIPE, ROOT, _env, run_prism

BASE = ["--nproc-per-node", "4", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "sandbox.ranks=[0]"]
# the recipe's defaults: 4 layers over 2 stages, seq 32, micro-batch 2, 4 micro-batches, top-2, 3 steps
SEQ, MBS, MICRO, TOPK, LAYERS_PER_STAGE, STEPS, RANKS = 32, 2, 4, 2, 2, 3, 4
SENT_PER_RANK_STEP = SEQ * MBS * TOPK * MICRO * LAYERS_PER_STAGE


def moe_stats_cli(trace):
    return subprocess.run([sys.executable, "-m", "prism_launch.report.moe_stats", str(trace)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    r = run_prism([*BASE, "mode=auto", "capture.payload=full", f"trace.dir={d / 'trace'}", *MOE_RECIPE], cwd=d,
                  timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return d / "trace", json.loads((d / "trace" / "report" / "report.json").read_text()), r.stderr


def test_the_report_has_the_recipes_routing(full):
    _trace, rep, err = full
    moe = rep["moe"]
    assert "error" not in moe, moe
    assert moe["num_experts"] == 4 and moe["ep_sizes"] == [2] and moe["detector"] == "megatron"
    # one dispatch per EP group (one per stage), layer of the stage, micro-batch and step
    assert moe["dispatches"] == moe["dispatches_verified"] == 2 * LAYERS_PER_STAGE * MICRO * STEPS
    o = moe["overall"]
    assert o["routed_tokens"] == sum(o["tokens_per_expert"]) == RANKS * SENT_PER_RANK_STEP * STEPS
    assert sum(o["tokens_per_ep_rank"].values()) == o["routed_tokens"] and sorted(o["tokens_per_ep_rank"]) == \
        ["0", "1", "2", "3"]
    mean = o["routed_tokens"] / 4
    assert o["expert_imbalance"] == pytest.approx(max(o["tokens_per_expert"]) / mean)
    assert o["dropped_tokens"] == 0 and "dropless" in moe["dropped_source"]  # no capacity factor given
    assert [s["step"] for s in moe["per_step"]] == list(range(STEPS))
    assert all(sum(s["tokens_per_expert"]) == RANKS * SENT_PER_RANK_STEP for s in moe["per_step"])
    assert all(v["sent_tokens"] == [SENT_PER_RANK_STEP] * STEPS for v in moe["per_rank"].values())
    busiest = max(o["tokens_per_ep_rank"], key=lambda r: o["tokens_per_ep_rank"][r])
    assert moe["effect"]["most_loaded_tokens"] == o["tokens_per_ep_rank"][busiest]
    assert set(moe["effect"]["per_rank"]) == {"0", "1", "2", "3"}
    assert "MoE routing (4 experts, EP [2], 48 dispatches)" in err  # and in the terminal


def test_moe_stats_prints_the_section_for_the_trace_alone(full):
    trace, rep, _err = full
    r = moe_stats_cli(trace)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["overall"] == rep["moe"]["overall"] and out["per_step"] == rep["moe"]["per_step"]
    assert "MoE routing (4 experts" in r.stderr


def test_an_exact_trace_says_why_it_has_no_routing_statistics(tmp_path):
    r = run_prism([*BASE, "mode=auto", f"trace.dir={tmp_path / 'trace'}", *MOE_RECIPE], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    moe = json.loads((tmp_path / "trace" / "report" / "report.json").read_text())["moe"]
    assert "capture.payload=exact" in moe["error"] and "capture.payload=full" in moe["error"]
    assert "MoE statistics unavailable" in r.stderr
    cli = moe_stats_cli(tmp_path / "trace")
    assert cli.returncode == 1 and "capture.payload=full" in cli.stderr
