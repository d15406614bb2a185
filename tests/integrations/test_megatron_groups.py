"""The group-creation fix of :mod:`integrations.megatron_compat`: megatron's rank groups built
from offsets are the original's lists, element for element, for every layout tried."""

from __future__ import annotations

import itertools

import pytest

parallel_state = pytest.importorskip("megatron.core.parallel_state")

from integrations.megatron_compat import _rank_groups_from_offsets  # noqa: E402

ORIGINAL = getattr(parallel_state.generate_masked_orthogonal_rank_groups, "__wrapped__",
                   parallel_state.generate_masked_orthogonal_rank_groups)
FAST = _rank_groups_from_offsets(ORIGINAL)


def test_every_mask_of_small_layouts_gives_the_original_groups():
    for sizes in itertools.product([1, 2, 3, 4], repeat=4):
        world = sizes[0] * sizes[1] * sizes[2] * sizes[3]
        for mask in itertools.product([True, False], repeat=4):
            assert FAST(world, list(sizes), list(mask)) == ORIGINAL(world, list(sizes), list(mask)), (sizes, mask)


@pytest.mark.parametrize("layout", [
    dict(tp=2, pp=2, dp=16, cp=1, ep=1), dict(tp=8, pp=4, dp=4, cp=2, ep=2), dict(tp=2, pp=1, dp=8, cp=4, ep=4),
])
def test_megatron_rank_generator_tokens_give_the_original_groups(layout):
    """What ``initialize_model_parallel`` asks for: every token of its decoder and expert orders."""
    world = layout["tp"] * layout["pp"] * layout["dp"] * layout["cp"]
    gen = parallel_state.RankGenerator(tp=layout["tp"], ep=1, dp=layout["dp"], pp=layout["pp"], cp=layout["cp"],
                                       order="tp-cp-ep-dp-pp", rank_offset=0)
    for token in ["tp", "pp", "dp", "cp", "tp-pp", "tp-cp", "dp-cp", "tp-dp-cp", "tp-cp-ep-dp-pp", "pp-dp"]:
        mask = gen.get_mask(gen.order, token)
        assert FAST(world, gen.ordered_size, mask) == ORIGINAL(world, gen.ordered_size, mask), token


def test_a_world_that_is_not_the_product_of_the_sizes_takes_the_original_path():
    with pytest.raises(AssertionError):
        ORIGINAL(12, [2, 2, 2], [True, False, False])
    with pytest.raises(AssertionError):
        FAST(12, [2, 2, 2], [True, False, False])


INIT = """
import json, sys
import torch.distributed as dist
from nccl_ext.frontend import install
if sys.argv[2] == "fixed":
    from integrations import megatron_compat
    megatron_compat.install()
from megatron.core import parallel_state as ps


class Transport:
    timeout_s = 30.0

    def register_group(self, group):
        pass

    def close(self):
        pass


install.install(rank=int(sys.argv[1]), world_size=32, make_transport=lambda *_: Transport(), timeout_s=30.0)
dist.init_process_group("gloo")
ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                             context_parallel_size=2)
key = lambda g: None if g is None else g.info.key  # noqa: E731
print(json.dumps({"fixed": hasattr(ps.create_group, "__wrapped__"),
                  "global": [key(g) for g in ps._global_process_group_list],
                  "getters": [key(f()) for f in (ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_group,
                                                 ps.get_data_parallel_group, ps.get_context_parallel_group,
                                                 ps.get_model_parallel_group, ps.get_embedding_group)]}))
"""


@pytest.mark.parametrize("rank", [0, 13])
def test_initialize_model_parallel_makes_the_same_groups_with_the_fix(rank):
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, _env

    out = {}
    for how in ("fixed", "original"):
        r = subprocess.run([sys.executable, "-c", INIT, str(rank), how], cwd=ROOT, env=_env(), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out[how] = json.loads(r.stdout.splitlines()[-1])
    assert out["fixed"].pop("fixed") and not out["original"].pop("fixed")
    assert out["fixed"] == out["original"]
    assert len(out["fixed"]["global"]) > 10 and None not in out["fixed"]["getters"]
