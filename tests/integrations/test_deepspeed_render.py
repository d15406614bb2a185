"""target.parallel rendered into the bundled DeepSpeed configs: ZeRO stage, pipeline stages,
expert-parallel size, batch sizes; the rules DeepSpeed imposes are errors naming the field."""

import json
from pathlib import Path

import pytest

from integrations.deepspeed_config import render as ds_render
from prism_launch.config import ConfigError, compose, resolve, validate

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "ds_configs"


def _cfg(*overrides, world=16):
    cfg = compose(["integration.kind=deepspeed", *overrides])
    cfg.target.nproc_per_node = world
    return resolve(cfg)


def _rendered(cfg, config: str, tmp_path) -> dict:
    out = ds_render(cfg, ["--deepspeed", "--deepspeed_config", str(CONFIGS / config)], tmp_path)
    assert out[:2] == ["--deepspeed", "--deepspeed_config"]
    return json.loads(Path(out[2]).read_text())


def test_zero_stage(tmp_path):
    ds = _rendered(_cfg("target.parallel.zero_stage=1"), "zero3.json", tmp_path)
    assert ds["zero_optimization"]["stage"] == 1
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0  # the rest is kept
    ds = _rendered(_cfg("target.parallel.zero_stage=3", "target.parallel.global_batch_size=64"), "zero1.json", tmp_path)
    assert ds["zero_optimization"]["stage"] == 3
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 2, 2)


def test_pipeline_stages_and_expert_parallel(tmp_path):
    ds = _rendered(_cfg("target.parallel.pp=4"), "pipe.json", tmp_path)
    assert ds["pipeline"]["stages"] == 4
    assert ds["train_batch_size"] == 2 * 4 * 4  # micro x accumulation x dp (16 / 4)
    ds = _rendered(_cfg("target.parallel.ep=4"), "moe.json", tmp_path)
    assert ds["moe"]["ep_size"] == 4


def test_deepspeed_rules_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="target.parallel.zero_stage=2.*pipeline engine"):
        _rendered(_cfg("target.parallel.zero_stage=2"), "pipe.json", tmp_path)
    with pytest.raises(ConfigError, match="target.parallel.ep=3"):
        _rendered(_cfg("target.parallel.ep=3"), "moe.json", tmp_path)
    with pytest.raises(ConfigError, match="zero_stage must be 0, 1, 2 or 3"):
        validate(_cfg("target.parallel.zero_stage=4"))
    cfg = resolve(compose(["target.parallel.zero_stage=1"]))
    with pytest.raises(ConfigError, match="integration.kind=deepspeed"):
        validate(cfg)
