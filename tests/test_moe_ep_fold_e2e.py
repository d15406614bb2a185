"""Expert-parallel folding at 1,024 ranks: a megatron-core MoE recipe with flag names of its own
(``--ep``, ``--pp``, rendered through ``integration.flags.*``), EP16·PP2, 16 experts, a router
skewed toward one expert, in the default ``mode=auto``. The capture runs 4 EP ranks per stage
(``capture.ep_sample=4``), not 32 ranks; the sandbox rank replays bit-identically; the ``moe``
section is there; the uncaptured EP ranks route as the captured routers did (checked on the
pieces the capture actually delivered, not on the report's arithmetic), and the hot expert's
EP rank is the one the others wait for."""

import json

import pytest

from nccl_ext.core.routing_counts import apportion
from prism_launch.trace import TraceReader
from tests.conftest import ROOT, run_prism

RECIPE = ROOT / "tests" / "workers" / "moe_own_flags.py"
HOT, EXPERTS, SANDBOX = 4, 16, 512
STAGE0, STAGE1 = list(range(16)), list(range(512, 528))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("epfold")
    r = run_prism(["--nnodes", "128", "--nproc-per-node", "8", "device=cpu", "capture.warm_imports=[torch]",
                   f"sandbox.ranks=[{SANDBOX}]", f"trace.dir={d / 'trace'}", "target.parallel.ep=16",
                   "target.parallel.pp=2", "integration.flags.ep=--ep", "integration.flags.pp=--pp",
                   RECIPE, "--experts", EXPERTS, "--layers", "4", "--steps", "2", "--hot-expert", HOT],
                  cwd=d, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return d / "trace", json.loads((d / "trace" / "report" / "report.json").read_text()), r.stderr


def test_few_ep_ranks_captured_and_the_sandbox_replays_exactly(run):
    trace, rep, err = run
    assert "captured 8 of 1024 logical ranks (folded)" in err
    fold = json.loads((trace / "fold.json").read_text())
    assert fold["captured"] == [0, 4, 8, 12, 512, 516, 520, 524] and fold["ep_positions"] == [0, 4, 8, 12]
    assert rep["ranks"][str(SANDBOX)]["losses_match_capture"] is True
    assert rep["ranks"][str(SANDBOX)]["losses"] and rep["ranks"][str(SANDBOX)]["divergences"] == []
    ep = rep["fold"]["expert_parallel"]
    assert ep["ops"]["count_gathers"] > 0 and ep["ops"]["pieces_synthesized"] > 0 and ep["ops"]["pieces_exact"] > 0
    moe = rep["moe"]
    assert "error" not in moe and moe["payload"] == "exact" and moe["num_experts"] == EXPERTS
    assert moe["fold"]["ep_ranks_derived"] == 24 and moe["ranks_counted"] == 32


def _dispatches(reader, rank):
    """(gather row, the combine all-to-all's piece sizes) of each dispatch of ``rank``: the combine
    sends back what the dispatch brought, so its pieces are the tokens received from each member."""
    evs = [r for r in reader.events_for_rank(rank) if r["kind"] == "collective"]
    out = []
    for i, row in enumerate(evs):
        extra = json.loads(row["extra"] or "{}")
        if extra.get("kind") == "all_gather" and len((extra.get("ints") or [[]])[0]) == EXPERTS:
            # the tokens' all-to-all, maybe the probabilities' (1-D pieces), then the combine
            a2a = [json.loads(r["extra"])["shapes"] for r in evs[i + 1:i + 5]
                   if json.loads(r["extra"] or "{}").get("kind") == "all_to_all"]
            combine = next(shapes for shapes in a2a[1:] if len(shapes[0]) == 2)
            out.append((row, [s[0] for s in combine]))
    return out


def test_uncaptured_ep_ranks_route_as_the_captured_routers(run):
    trace, rep, _err = run
    reader = TraceReader(trace)
    captured = [0, 4, 8, 12]
    per_rank = {r: _dispatches(reader, r) for r in captured}
    n = len(per_rank[0])
    assert n == 2 * 4 * 2  # steps x micro-batches x layers of the stage
    differs = 0
    for k in range(n):
        counts = {r: json.loads(per_rank[r][k][0]["extra"])["ints"][0] for r in captured}
        summed = [sum(c[e] for c in counts.values()) for e in range(EXPERTS)]
        for j in captured:  # EP rank j owns expert j (16 experts over 16 ranks)
            received = per_rank[j][k][1]
            for i in STAGE0:
                if i in captured:
                    assert received[i] == counts[i][j]  # exact: the captured peer's real piece
                    continue
                derived = apportion(summed, sum(counts[0]), salt=i)  # uncaptured ranks mirror rank 0's shard
                assert received[i] == derived[j], (k, i, j)
                differs += derived[j] != counts[0][j]
    assert differs > 0  # not copies of one rank's routing
    moe = rep["moe"]
    for u in (1, 2, 3, 513, 527):
        v = moe["per_rank"][str(u)]
        assert v["derived"] and max(range(EXPERTS), key=lambda e: v["tokens_per_expert"][e]) == HOT


def test_the_hot_experts_ep_rank_is_the_one_the_others_wait_for(run):
    _trace, rep, err = run
    moe = rep["moe"]
    assert moe["overall"]["hottest_expert"] == HOT
    eff = moe["effect"]
    assert eff["most_loaded_rank"] in (HOT, 512 + HOT)
    hot_tokens = moe["overall"]["tokens_per_ep_rank"][str(HOT)]
    assert hot_tokens == max(moe["overall"]["tokens_per_ep_rank"].values())
    # the hot rank computes longest and arrives last: it waits least at the all-to-alls, the rest wait for it
    waits = {int(r): v["a2a_wait_s"] for r, v in eff["per_rank"].items() if int(r) in STAGE0}
    assert min(waits, key=waits.get) == HOT and eff["a2a_wait_excess_s"] > 0
    assert "MoE routing (16 experts, EP [16]" in err


def test_payload_none_routes_by_the_captured_routers_too(tmp_path):
    """``payload=none``: the count all-gathers on EP groups are computed for real (uncaptured
    members' counts derived as above), so every EP rank's all-to-all sizes follow the routing
    instead of n times its own self-routed count; the sandbox still replays bit-identically."""
    r = run_prism(["--nnodes", "128", "--nproc-per-node", "8", "device=cpu", "capture.warm_imports=[torch]",
                   f"sandbox.ranks=[{SANDBOX}]", "capture.payload=none", f"trace.dir={tmp_path / 'trace'}",
                   "target.parallel.ep=16", "target.parallel.pp=2", "integration.flags.ep=--ep",
                   "integration.flags.pp=--pp", RECIPE, "--experts", EXPERTS, "--layers", "4", "--steps", "2",
                   "--hot-expert", HOT], cwd=tmp_path, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads((tmp_path / "trace" / "report" / "report.json").read_text())
    assert rep["ranks"][str(SANDBOX)]["losses_match_capture"] is True
    assert rep["fold"]["expert_parallel"]["ops"]["count_gathers"] == 2 * 2 * 4 * 2  # stages x layers x micro x steps
    reader = TraceReader(tmp_path / "trace")
    for k, (gather, received) in enumerate(_dispatches(reader, HOT)):
        # the hot expert's rank received every member's share of the hot expert, not 16 x its own
        own = json.loads(gather["extra"])["ints"][0][HOT]
        assert sum(received) > 4 * own and sum(received) == pytest.approx(16 * own, rel=0.25), k
    moe = rep["moe"]
    assert moe["payload"] == "none" and moe["overall"]["hottest_expert"] == HOT
