"""``target.parallel`` rendered into torchtitan's ``--parallelism.*``/``--training.*`` flags."""

from types import SimpleNamespace

import pytest

from integrations.torchtitan_flags import render
from prism_launch.config import ConfigError


def _cfg(world, **par):
    fields = ("tp", "pp", "ep", "cp", "etp", "micro_batch_size", "global_batch_size")
    return SimpleNamespace(target=SimpleNamespace(world_size=world, parallel=SimpleNamespace(
        **{f: par.get(f) for f in fields})), integration=SimpleNamespace(flags=SimpleNamespace(
            **{f: None for f in fields})), script=SimpleNamespace(args={}))


def test_tp_replaces_the_scripts_degree_and_dp_shard_fills_the_world():
    args = ["--model.name", "llama3", "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree=4"]
    out = render(_cfg(1024, tp=4, micro_batch_size=2), args)
    assert out == ["--model.name", "llama3", "--parallelism.tensor_parallel_degree", "4",
                   "--parallelism.data_parallel_shard_degree=256", "--training.local_batch_size", "2"]


def test_pp_cp_and_replicas_divide_the_world():
    out = render(_cfg(64, pp=2, cp=2), ["--parallelism.data_parallel_replicate_degree", "2"])
    assert out[out.index("--parallelism.data_parallel_shard_degree") + 1] == "8"
    with pytest.raises(ConfigError, match="does not divide the world of 12"):
        render(_cfg(12, tp=8), [])


def test_nothing_set_leaves_the_args_alone():
    assert render(_cfg(8), ["--model.flavor", "debugmodel"]) == ["--model.flavor", "debugmodel"]
