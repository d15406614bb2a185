"""The deepspeed launcher's flags on prism-launch's command line: the target world they
describe, --local_rank passed like the deepspeed launcher, the DeepSpeed defaults a script
with --deepspeed_config gets, and the flags that are accepted and ignored."""

import pytest

from prism_launch.launch.args import parse

SCRIPT = ["examples/deepspeed_gpt.py", "--deepspeed", "--deepspeed_config", "examples/ds_configs/zero3.json"]


def test_num_gpus_and_num_nodes_describe_the_world():
    a = parse(["--num_gpus", "8", "--num_nodes", "128", "--master_addr", "10.0.0.1", "--master_port", "29600",
               "sandbox.ranks=[5]", *SCRIPT])
    assert (a.nnodes, a.nproc_per_node) == (128, 8)
    assert a.local_rank_arg
    assert a.torchrun.master_addr == "10.0.0.1" and a.torchrun.master_port == 29600
    assert "sandbox.ranks=[5]" in a.overrides
    assert a.script == SCRIPT[0] and a.script_args == SCRIPT[1:]


def test_num_accelerators_alias_and_no_local_rank():
    a = parse(["--num_accelerators", "4", "--no_local_rank", *SCRIPT])
    assert (a.nnodes, a.nproc_per_node) == (1, 4)
    assert not a.local_rank_arg


def test_torchrun_flags_keep_torchrun_behaviour():
    a = parse(["--nnodes", "2", "--nproc-per-node", "4", *SCRIPT])
    assert (a.nnodes, a.nproc_per_node) == (2, 4)
    assert not a.local_rank_arg  # torchrun passes no --local_rank


def test_hostfile_include_exclude(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("# the cluster\nworker-0 slots=8\nworker-1 slots=8\nworker-2 slots=8\n")
    a = parse(["--hostfile", str(hf), *SCRIPT])
    assert (a.nnodes, a.nproc_per_node) == (3, 8)
    a = parse(["-H", str(hf), "--num_nodes", "2", "--num_gpus", "4", *SCRIPT])
    assert (a.nnodes, a.nproc_per_node) == (2, 4)
    a = parse(["-H", str(hf), "--include", "worker-0:0,1@worker-2:2,3", *SCRIPT])
    assert (a.nnodes, a.nproc_per_node) == (2, 2)
    a = parse(["-H", str(hf), "--exclude", "worker-1", *SCRIPT])
    assert (a.nnodes, a.nproc_per_node) == (2, 8)
    with pytest.raises(SystemExit):
        parse(["-H", str(hf), "--exclude", "worker-1:0", *SCRIPT])  # 8 + 7 + 8 slots: not one size per node
    with pytest.raises(SystemExit):
        parse(["-H", str(hf), "--include", "worker-0", "--exclude", "worker-1", *SCRIPT])


def test_ignored_launcher_flags_are_accepted():
    a = parse(["--num_gpus", "2", "--launcher", "slurm", "--launcher_args", "-p x", "--no_ssh", "--force_multi",
               "--bind_cores_to_rank", "--log_level", "warning", "-q", "--enable_each_rank_log", "/tmp/x", *SCRIPT])
    assert (a.nnodes, a.nproc_per_node) == (1, 2)
    assert a.script == SCRIPT[0]


def test_deepspeed_script_gets_deepspeed_defaults():
    a = parse(["--nproc-per-node", "4", *SCRIPT])
    assert any(o.startswith("compat.integrations=") and "deepspeed" in o for o in a.overrides)
    assert any(o.startswith("capture.warm_imports=") and "deepspeed" in o for o in a.overrides)
    own = parse(["--nproc-per-node", "4", "compat.integrations=[deepspeed]", *SCRIPT])
    assert [o for o in own.overrides if o.startswith("compat.integrations=")] == ["compat.integrations=[deepspeed]"]
    plain = parse(["--nproc-per-node", "4", "examples/megatron_gpt.py", "--tensor-model-parallel-size", "2"])
    assert plain.overrides == []


def test_deepspeed_defaults_compose():
    from prism_launch.config import compose

    cfg = compose(parse(["--num_gpus", "4", *SCRIPT]).overrides)
    assert cfg.compat.integrations[-1] == "deepspeed"
    assert "cpu" in cfg.compat.integrations
    assert "deepspeed" in cfg.capture.warm_imports
