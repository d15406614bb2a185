"""Rendering target.parallel / script.args into a recipe's flags or DeepSpeed config, and
the up-front validation of parallel sizes (no runs)."""

import json

import pytest

from integrations.deepspeed_config import render as ds_render
from integrations.deepspeed_config import render_config
from integrations.megatron_flags import get_flag, render, set_flag
from prism_launch.config import ConfigError, ParallelConfig, compose, resolve


def _cfg(*overrides, world=16):
    cfg = compose([f"target.world_size={world}", "device=cpu", *overrides])
    return resolve(cfg)


def test_megatron_default_names_replace_and_append():
    args = ["--tensor-model-parallel-size", "2", "--num-layers", "4", "--micro-batch-size=4"]
    out = render(_cfg("target.parallel.tp=4", "target.parallel.pp=2", "target.parallel.micro_batch_size=1",
                      "target.parallel.global_batch_size=16"), args)
    assert out == ["--tensor-model-parallel-size", "4", "--num-layers", "4", "--micro-batch-size=1",
                   "--pipeline-model-parallel-size", "2", "--global-batch-size", "16"]


def test_nothing_set_leaves_args_alone():
    args = ["--tensor-model-parallel-size", "2", "--foo", "bar"]
    assert render(_cfg(), args) == args


def test_equals_form_underscore_spelling_and_every_occurrence():
    args = ["--context_parallel_size", "1", "--expert-model-parallel-size=1", "--expert-model-parallel-size", "1",
            "--num-experts", "8"]
    out = render(_cfg("target.parallel.cp=2", "target.parallel.ep=4"), args)
    assert out == ["--context_parallel_size", "2", "--expert-model-parallel-size=4",
                   "--expert-model-parallel-size", "4", "--num-experts", "8"]


def test_custom_flag_names():
    out = render(_cfg("target.parallel.tp=2", "target.parallel.pp=2", "integration.flags.tp=--tp",
                      "integration.flags.pp=--pipeline"), ["--tp", "1", "--lr", "0.1"])
    assert out == ["--tp", "2", "--lr", "0.1", "--pipeline", "2"]


def test_script_args_values_bare_flags_and_removal():
    cfg = _cfg("script.args.moe_router_topk=1", "script.args.sequence_parallel=true",
               "script.args.moe_aux_loss_coeff=false", "script.args.moe_expert_capacity_factor=null",
               "script.args.lr=-0.001")
    out = render(cfg, ["--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--x"])
    assert out == ["--moe-router-topk", "1", "--x", "--sequence-parallel", "--lr", "-0.001"]
    assert get_flag(out, "--sequence-parallel") is True and get_flag(out, "--lr") == "-0.001"


def test_set_flag_lists_and_negative_values():
    assert set_flag(["--a", "1", "2", "--b"], "--a", [3, 4, 5]) == ["--a", "3", "4", "5", "--b"]
    assert set_flag(["--lr", "-1e-3", "pos"], "--lr", 0.5) == ["--lr", "0.5", "pos"]


@pytest.mark.parametrize("overrides,args,field", [
    (["target.parallel.tp=3"], [], "target.parallel.tp=3"),
    (["target.parallel.tp=2", "target.parallel.pp=3"], [], "target.parallel.tp=2, target.parallel.pp=3"),
    (["target.parallel.ep=3"], ["--num-experts", "6"], "target.parallel.ep=3"),
    (["target.parallel.ep=4"], ["--num-experts", "6"], "target.parallel.ep=4"),
    (["target.parallel.tp=8"], ["--num-attention-heads", "4"], "target.parallel.tp=8"),
    (["target.parallel.pp=8"], ["--num-layers", "4"], "target.parallel.pp=8"),
    (["target.parallel.global_batch_size=12"], ["--micro-batch-size", "2"], "target.parallel.global_batch_size=12"),
    (["target.parallel.etp=2", "target.parallel.ep=4", "target.parallel.pp=4"], [], "target.parallel.etp=2"),
])
def test_invalid_combinations_name_the_field(overrides, args, field):
    with pytest.raises(ConfigError) as e:
        render(_cfg(*overrides), args)
    assert str(e.value).startswith(field), str(e.value)


def test_valid_moe_combination():
    out = render(_cfg("target.parallel.tp=2", "target.parallel.ep=4", "target.parallel.etp=1",
                      "target.parallel.global_batch_size=32", "target.parallel.micro_batch_size=1"),
                 ["--num-experts", "8", "--num-attention-heads", "4"])
    assert get_flag(out, "--expert-tensor-parallel-size") == "1"


def test_deepspeed_config_rendered_copy(tmp_path):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                               "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 1}}))
    cfg = _cfg("integration.kind=deepspeed", "target.parallel.tp=2", "target.parallel.pp=2",
               "target.parallel.ep=2", "target.parallel.micro_batch_size=2", "target.parallel.global_batch_size=32",
               "integration.flags.tp=--tensor-model-parallel-size")
    out = ds_render(cfg, ["--deepspeed_config", str(src), "--zero-stage", "1"], tmp_path / "point0")
    path = out[1]
    assert out[0] == "--deepspeed_config" and path != str(src) and path.startswith(str(tmp_path / "point0"))
    ds = json.loads(open(path).read())
    # world 16 / (tp 2 x pp 2) = dp 4; 32 = 2 x 4 x 4
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["train_batch_size"] == 32
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["pipeline"]["stages"] == 2 and ds["moe"]["ep_size"] == 2 and ds["tensor_parallel"]["autotp_size"] == 2
    assert ds["zero_optimization"] == {"stage": 1}
    assert out[2:] == ["--zero-stage", "1", "--tensor-model-parallel-size", "2"]
    assert json.loads(src.read_text())["train_micro_batch_size_per_gpu"] == 4  # the original is untouched
    # the same content renders to the same file (traces keyed by it are reused)
    assert ds_render(cfg, [f"--deepspeed-config={src}"], tmp_path / "point0") == [f"--deepspeed-config={path}",
                                                                                    "--tensor-model-parallel-size", "2"]


def test_deepspeed_batch_consistency_and_errors(tmp_path):
    ds = render_config({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8,
                       ParallelConfig(tp=2))
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (8, 64, 2)
    assert "tensor_parallel" not in ds  # AutoTP only where the config uses it
    with pytest.raises(ConfigError, match="target.parallel.global_batch_size"):
        render_config({}, 8, ParallelConfig(micro_batch_size=3, global_batch_size=16))
    with pytest.raises(ConfigError, match="target.parallel.ep"):
        render_config({}, 8, ParallelConfig(tp=2, ep=3))
    with pytest.raises(ConfigError, match="deepspeed_config"):
        ds_render(_cfg("integration.kind=deepspeed", "target.parallel.tp=2"), ["--lr", "1"], tmp_path)
