"""The bundled DeepSpeed MoE recipe's ``moe`` section under the default ``mode=auto`` (an exact
trace): the tokens per expert, per rank, step and layer, and the dropped tokens are what the
recipe's own gates computed (``--log-gate-counts`` prints them); in a 1,024-rank world folded with
``capture.ep_sample`` the captured routers' counts are theirs and the other EP ranks' derived."""

import json
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, run_prism

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'prism-launch[deepspeed]')")

EXPERTS, LAYERS, MICRO, ITERS, TOKENS = 4, 2, 2, 3, 2 * 32   # the recipe's defaults and moe.json's micro-batch
SCRIPT = [EXAMPLES / "deepspeed_moe.py", "--deepspeed", "--deepspeed_config", EXAMPLES / "ds_configs" / "moe.json",
          "--log-gate-counts"]


def gate_lines(log_dir: Path) -> list[dict]:
    """Every gate's counts the recipe printed in the capture (``gate_counts {json}``)."""
    [run] = [p for p in log_dir.iterdir() if p.is_dir() and "-capture-" in p.name]
    out = []
    for rank_dir in run.iterdir():
        if rank_dir.is_dir():
            out += [json.loads(line.split(" ", 1)[1]) for line in (rank_dir / "stdout.log").read_text().splitlines()
                    if line.startswith("gate_counts ")]
    return out


def _sum(rows: list[dict], field: str) -> list[int]:
    return [sum(r[field][e] for r in rows) for e in range(EXPERTS)]


def test_the_moe_section_has_the_recipes_gate_counts(tmp_path):
    r = run_prism(["--num_gpus", "8", "-r", "3", "device=cpu", "comm.timeout_s=120", "--log-dir", tmp_path / "logs",
                   "mode=auto", f"trace.dir={tmp_path / 'trace'}", *SCRIPT, "--ep-size", "4"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    report = tmp_path / "trace" / "report"
    moe = json.loads((report / "report.json").read_text())["moe"]
    gates = gate_lines(tmp_path / "logs")
    assert len(gates) == 8 * LAYERS * MICRO * ITERS and all(sum(g["exp_counts"]) == TOKENS for g in gates)

    assert moe["detector"] == "deepspeed" and moe["payload"] == "exact" and moe["ep_sizes"] == [4]
    assert moe["num_experts"] == EXPERTS and moe["dispatches"] == moe["dispatches_verified"] == 2 * LAYERS * MICRO * ITERS
    o = moe["overall"]
    assert o["tokens_per_expert"] == _sum(gates, "routed")
    assert o["dropped_tokens"] == sum(_sum(gates, "exp_counts")) - sum(_sum(gates, "routed")) > 0  # capacity 16 binds
    for rank in range(8):
        mine = [g for g in gates if g["rank"] == rank]
        assert moe["per_rank"][str(rank)]["tokens_per_expert"] == _sum(mine, "routed")
        # EP rank j of its group (ranks 0-3, 4-7) holds expert j: every member's tokens for it
        group = [g for g in gates if g["rank"] // 4 == rank // 4]
        assert o["tokens_per_ep_rank"][str(rank)] == sum(g["routed"][rank % 4] for g in group)
    steps = moe["per_step"]
    assert len(steps) == ITERS
    for step, it in zip(steps, range(1, ITERS + 1)):
        assert step["tokens_per_expert"] == _sum([g for g in gates if g["iter"] == it], "routed")
    layers = {(x["ep_group_first_rank"], x["layer"]): x["tokens_per_expert"] for x in moe["per_layer"]}
    want = defaultdict(list)
    for g in gates:
        want[(g["rank"] // 4 * 4, g["layer"])].append(g)
    assert layers == {k: _sum(v, "routed") for k, v in want.items()}
    mean = sum(o["tokens_per_expert"]) / EXPERTS
    assert o["expert_imbalance"] == pytest.approx(max(o["tokens_per_expert"]) / mean)
    eff = moe["effect"]
    assert eff["most_loaded_tokens"] == max(o["tokens_per_ep_rank"].values()) and len(eff["per_rank"]) == 8
    assert (report / moe["plot"]).exists()
    assert "MoE routing (4 experts, EP [4], 24 dispatches)" in r.stderr
    # the gates' auxiliary losses, bit for bit what they returned, every captured gate call
    aux = moe["aux_losses"]["l_aux"]
    assert aux["calls"] == len(gates) and aux["ranks"] == 8
    assert aux["mean"] == pytest.approx(sum(g["l_aux"] for g in gates) / len(gates), rel=1e-12)
    for step, it in zip(aux["per_step"], range(1, ITERS + 1)):
        mine = [g["l_aux"] for g in gates if g["iter"] == it]
        assert step["mean"] == pytest.approx(sum(mine) / len(mine), rel=1e-12)
    assert o["aux_loss"] == aux["mean"] and o["aux_loss_name"] == "l_aux"
    assert "auxiliary losses" in r.stderr and "l_aux" in r.stderr


def test_a_1024_rank_world_folded_to_four_routers_of_one_ep_group(tmp_path):
    """EP 16 over 1,024 ranks, sandbox rank 1001 (EP position 9): ``capture.ep_sample=4`` (the
    default) captures positions 1, 5, 9, 13 of its group (DeepSpeed's ``DEEPSPEED_EXPERT_PARALLEL``)
    and derives the other twelve routers' counts from theirs."""
    r = run_prism(["--nnodes", "128", "--nproc-per-node", "8", "-r", "3", "device=cpu", "comm.timeout_s=120",
                   "capture.fold=true", "sandbox.ranks=[1001]", "--log-dir", tmp_path / "logs", "mode=auto",
                   f"trace.dir={tmp_path / 'trace'}", *SCRIPT, "--num-experts", "16", "--ep-size", "16"],
                  cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "captured 4 of 1024 logical ranks" in r.stderr
    moe = json.loads((tmp_path / "trace" / "report" / "report.json").read_text())["moe"]
    gates = gate_lines(tmp_path / "logs")
    captured = [993, 997, 1001, 1005]
    assert sorted({g["rank"] for g in gates}) == captured
    assert moe["fold"]["ep_positions"] == [1, 5, 9, 13] and moe["fold"]["ep_ranks_derived"] == 12
    assert moe["ep_sizes"] == [16] and moe["dispatches"] == moe["dispatches_verified"] == LAYERS * MICRO * ITERS
    per_rank = moe["per_rank"]
    assert sorted(map(int, per_rank)) == list(range(992, 1008))
    for rank in captured:  # the captured routers' counts are their gates'
        mine = [g for g in gates if g["rank"] == rank]
        assert per_rank[str(rank)]["tokens_per_expert"] == [sum(g["routed"][e] for g in mine) for e in range(16)]
        assert not per_rank[str(rank)]["derived"]
    capacity = 4  # ceil(64 tokens / 16 experts), min_capacity 4
    for rank, v in per_rank.items():
        if v["derived"]:  # an uncaptured gate keeps at most the capacity per expert and dispatch too
            assert all(n <= capacity * LAYERS * MICRO * ITERS for n in v["tokens_per_expert"])
            assert sum(v["sent_tokens"]) > 0
    o = moe["overall"]
    assert o["routed_tokens"] == sum(sum(v["tokens_per_expert"]) for v in per_rank.values())
    assert o["dropped_tokens"] >= sum(sum(g["exp_counts"]) - sum(g["routed"]) for g in gates) > 0
