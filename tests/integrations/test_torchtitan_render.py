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


def test_torchtitan_recipe_gets_its_integration_kind():
    """A torchtitan command line (``-m torchtitan.train --model.name …``) takes integration.kind=
    torchtitan (its renderer and workload), unless the user names one; DeepSpeed's flag alone
    does not claim a recipe (Megatron-DeepSpeed passes it beside Megatron-LM's flags)."""
    from prism_launch.config import compose
    from prism_launch.launch.args import parse

    script = ["-m", "torchtitan.train", "--model.name", "llama3", "--model.flavor", "debugmodel"]
    a = parse(["--nproc-per-node", "8", *script])
    assert "integration.kind=torchtitan" in a.overrides
    cfg = compose(a.overrides)
    assert cfg.integration.kind == "torchtitan" and "torchtitan" in cfg.compat.integrations
    own = parse(["--nproc-per-node", "8", "integration.kind=none", *script])
    assert [o for o in own.overrides if o.startswith("integration.kind")] == ["integration.kind=none"]
    ds = parse(["--nproc-per-node", "4", "examples/deepspeed_gpt.py", "--deepspeed_config", "x.json"])
    assert not any(o.startswith("integration.kind") for o in ds.overrides)
