"""A real MoE run's ``moe`` section: the bundled Megatron-core recipe as PP2·EP2 (conftest's
MOE_RECIPE) captured with every tensor, emulated, and its routing statistics checked against
what the recipe routes by construction; ``python -m prism_launch.report.moe_stats TRACE_DIR``
prints the same section for the trace alone. Under the default ``mode=auto`` (an exact trace,
which keeps no other rank's tensors) the token counts kept by value give the same section."""

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
    # the routers' load-balancing loss (coefficient 0.01): one value per router call of every
    # captured rank (4 ranks x 2 layers of its stage x 4 micro-batches x 3 steps), layers 1-4
    aux = moe["aux_losses"]["load_balancing_loss"]
    assert aux["calls"] == RANKS * LAYERS_PER_STAGE * MICRO * STEPS and aux["ranks"] == RANKS
    assert [x["layer"] for x in aux["per_layer"]] == [1, 2, 3, 4] and len(aux["per_step"]) == STEPS
    # E * sum(f_e * P_e) / top-k: 1 when balanced, at most E / top-k
    assert 0.9 < aux["mean"] < 4 / TOPK and o["aux_loss"] == aux["mean"]
    assert "load_balancing_loss" in err


def test_moe_stats_prints_the_section_for_the_trace_alone(full):
    trace, rep, _err = full
    r = moe_stats_cli(trace)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["overall"] == rep["moe"]["overall"] and out["per_step"] == rep["moe"]["per_step"]
    assert "MoE routing (4 experts" in r.stderr


def test_an_exact_trace_has_the_same_routing_statistics(full, tmp_path):
    """The default payload keeps no other rank's tensors, yet every captured rank's token counts
    are in the events: the section is there and routes exactly as the full trace's."""
    r = run_prism([*BASE, "mode=auto", f"trace.dir={tmp_path / 'trace'}", *MOE_RECIPE], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    moe = json.loads((tmp_path / "trace" / "report" / "report.json").read_text())["moe"]
    assert "error" not in moe and moe["payload"] == "exact", moe
    ref = full[1]["moe"]
    assert moe["overall"]["tokens_per_expert"] == ref["overall"]["tokens_per_expert"]
    assert moe["overall"]["tokens_per_ep_rank"] == ref["overall"]["tokens_per_ep_rank"]
    assert moe["aux_losses"] == ref["aux_losses"]  # the same routers' values, whatever the payload
    assert moe["dispatches"] == moe["dispatches_verified"] == ref["dispatches"]
    # layers of a stage from the op order: 2 stages x 2 layers, each layer once per micro-batch and step
    assert [(x["ep_group_first_rank"], x["layer"]) for x in moe["per_layer"]] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert all(sum(x["tokens_per_expert"]) == 2 * SEQ * MBS * TOPK * MICRO * STEPS for x in moe["per_layer"])
    assert (tmp_path / "trace" / "report" / moe["plot"]).stat().st_size > 0
    assert "MoE routing (4 experts" in r.stderr
    cli = moe_stats_cli(tmp_path / "trace")
    assert cli.returncode == 0 and json.loads(cli.stdout)["overall"] == moe["overall"]
