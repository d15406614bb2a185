"""The bundled Megatron recipe's sample stream: each replica's slice of a global batch, and
``--replicate-data`` giving every replica the same tokens whatever the data-parallel size."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("megatron_gpt_recipe", EXAMPLES / "megatron_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _samples(recipe, argv, dp_size, dp_rank, iteration):
    args = recipe.parse_args(argv)
    args.global_batch_size = 4 * args.micro_batch_size * dp_size  # the recipe's default
    micro = args.global_batch_size // (args.micro_batch_size * dp_size)
    first = recipe.first_sample(args, micro, iteration, dp_rank)
    return list(range(first, first + args.micro_batch_size * micro))


def test_replicas_take_disjoint_slices_that_cover_each_global_batch(recipe):
    for it in range(3):
        seen = [i for r in range(4) for i in _samples(recipe, ["--micro-batch-size", "2"], 4, r, it)]
        assert sorted(seen) == list(range(it * 32, (it + 1) * 32))


def test_replicated_data_is_the_same_at_every_data_parallel_size(recipe):
    argv = ["--micro-batch-size", "2", "--replicate-data"]
    for it in range(3):
        ref = _samples(recipe, argv, 1, 0, it)
        assert len(ref) == 8
        for dp in (2, 16, 1024):
            for r in (0, 1, dp - 1):
                assert _samples(recipe, argv, dp, r, it) == ref, (it, dp, r)
    # consecutive iterations move on to new samples
    assert set(_samples(recipe, argv, 16, 3, 0)).isdisjoint(_samples(recipe, argv, 16, 3, 1))
