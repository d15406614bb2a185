"""``capture.gpu_waits`` unset: the integrations decide, by the recipe's script arguments."""

from __future__ import annotations

import pytest

from prism_launch.config import compose, registry

DENSE = ["--num-layers", "4", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("override, value", [(None, None), ("capture.gpu_waits=true", True),
                                             ("capture.gpu_waits=false", False), ("capture.gpu_waits=null", None)])
def test_the_setting_is_true_false_or_unset(override, value):
    cfg = compose(["device=cpu", "target.world_size=8", *([override] if override else [])])
    assert cfg.capture.gpu_waits is value


def test_a_megatron_recipe_without_moe_is_vouched_for():
    on, why = registry.choose_gpu_waits(None, DENSE)
    assert on is True and why.startswith("megatron: ") and "without MoE" in why


@pytest.mark.parametrize("flag", [["--num-experts", "4"], ["--num-experts=8"]])
def test_moe_speaks_against_them_whatever_else_vouches(flag):
    on, why = registry.choose_gpu_waits(None, [*DENSE, *flag])
    assert on is False and "--num-experts" in why and "pageable host memory" in why


def test_a_recipe_no_integration_knows_gets_none():
    on, why = registry.choose_gpu_waits(None, ["--deepspeed_config", "ds.json", "--epochs", "1"])
    assert on is False and "no integration" in why


def test_an_explicit_setting_wins():
    assert registry.choose_gpu_waits(False, DENSE) == (False, "capture.gpu_waits=false")
    assert registry.choose_gpu_waits(True, [*DENSE, "--num-experts", "4"]) == (True, "capture.gpu_waits=true")
