"""EP folding's parts: the fold plan samples EP positions, the same in every stage; uncaptured
members' counts and all-to-all pieces follow the captured routers."""

import torch

from nccl_ext.core.ops import Collective
from nccl_ext.core.routing_counts import apportion
from prism_launch.capture.ep_fold import EpFold, derived_counts
from prism_launch.capture.fold import ep_positions, plan
from prism_launch.capture.ops_state import OpGroup, PendingCollective

DP = ["DATA_PARALLEL", "default_pg"]


def _groups(world=64, ep=8, pp=2):
    """World 64 = DP 32 x PP 2; EP 8 inside each stage's data-parallel ranks."""
    per_stage = world // pp
    out = [(list(range(world)), "default_pg")]
    for s in range(pp):
        stage = list(range(s * per_stage, (s + 1) * per_stage))
        out.append((stage, "DATA_PARALLEL_GROUP"))
        for g in range(0, per_stage, ep):
            out.append((stage[g:g + ep], "EXPERT_MODEL_PARALLEL_GROUP"))
        for p in range(ep):
            out.append((stage[p::ep], "EXPERT_DATA_PARALLEL_GROUP"))
    for r in range(per_stage):
        out.append(([r, r + per_stage], "PIPELINE_MODEL_PARALLEL_GROUP"))
    return out


def test_positions_start_at_the_seed_and_spread():
    assert ep_positions(16, [0], 4) == [0, 4, 8, 12]
    assert ep_positions(16, [5], 4) == [1, 5, 9, 13]
    assert ep_positions(8, [2, 3], 3) == [2, 3, 5]


def test_plan_samples_ep_positions_in_every_stage():
    p = plan(_groups(), [33], 64, DP, ep_sample=2)
    assert p.ep_positions == [1, 5] and p.captured == [1, 5, 33, 37]
    assert p.rep[2] in p.captured and p.rep[34] in (33, 37)
    whole = plan(_groups(), [33], 64, DP, ep_sample=None)
    assert whole.captured == [0, 1, 2, 3, 4, 5, 6, 7, 32, 33, 34, 35, 36, 37, 38, 39] and whole.ep_positions == []
    assert plan(_groups(), [33], 64, DP, ep_sample=8).ep_positions == []  # the whole group: nothing sampled


def test_apportion_keeps_the_total_and_the_shape_of_the_distribution():
    assert apportion([6, 2, 0, 0], 8) == [6, 2, 0, 0]
    assert apportion([1, 1, 1, 1], 6, salt=2) == [1, 1, 2, 2]
    assert apportion([0, 0], 3) in ([2, 1], [1, 2])
    got = derived_counts({0: [10, 0, 2, 0], 4: [6, 2, 0, 0]}, [0, 1, 4, 5], {1: 0, 5: 4})
    assert got[0] == [10, 0, 2, 0] and got[1] == apportion([16, 2, 2, 0], 12, salt=1) and sum(got[5]) == 8


def _pending(kind, contributions, ranks=(0, 1, 2, 3), sources=(0, 0, 2, 2)):
    g = OpGroup(0, "ep", tuple(ranks), 0, "EXPERT_MODEL_PARALLEL_GROUP", present=2)
    g.sources = tuple(sources)
    return PendingCollective(g, 7, "op", kind, None, None, 0.0, list(contributions))


class _Fold:
    ep_positions = [0, 2]


def test_uncaptured_members_gather_the_captured_distribution_and_send_the_sizes_expected():
    ep = EpFold(_Fold())
    c0, c2 = torch.tensor([5, 1, 2, 0]), torch.tensor([3, 3, 0, 2])
    pc = _pending(Collective.ALL_GATHER, [[c0], None, [c2], None])
    assert ep.applies(pc.group)
    out = ep.contributions(pc, [[c0], [c0], [c2], [c2]])
    assert out[0][0] is c0 and out[2][0] is c2
    assert out[1][0].tolist() == apportion([8, 4, 2, 2], 8, salt=1) and out[3][0].tolist() == apportion([8, 4, 2, 2], 8, salt=3)
    # all-to-all: captured receivers 0 and 2 said what they expect from each member
    H = 3
    mine0 = [torch.full((n, H), 10.0 + i) for i, n in enumerate([1, 1, 1, 1])]
    mine2 = [torch.full((n, H), 20.0 + i) for i, n in enumerate([2, 0, 1, 1])]
    ep.note_outs(0, "ep", 7, [[1, H], [4, H], [2, H], [3, H]])
    ep.note_outs(2, "ep", 7, [[1, H], [0, H], [1, H], [5, H]])
    pc = _pending(Collective.ALL_TO_ALL, [mine0, None, mine2, None])
    out = ep.contributions(pc, [mine0, mine0, mine2, mine2])
    assert out[0] == mine0 and out[2] == mine2                  # captured members' real pieces
    assert out[1][0].shape == (4, H) and out[1][2].shape == (0, H)  # sized as receivers 0 and 2 expect
    assert out[3][0].shape == (3, H) and out[3][2].shape == (5, H)
    assert out[3][2].dtype == torch.float32 and set(out[3][2][:, 0].tolist()) <= {20.0, 22.0, 23.0}
    assert ep.synthesized["pieces_synthesized"] == 4
