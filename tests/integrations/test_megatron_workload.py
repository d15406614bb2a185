"""Tokens per step and Megatron-LM's FLOP formula from a Megatron recipe's flags."""

import pytest

from integrations.megatron_workload import num_floating_point_operations, shape, tokens_per_step

LLAMA3_8B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
             "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--swiglu", "--seq-length", "4096",
             "--padded-vocab-size", "128256"]


def test_the_formula_gives_llama3_8bs_flops_per_token():
    # forward per token per layer: QKV 50.3 M + output 33.6 M + SwiGLU MLP 352.3 M + attention
    # 4·s·h = 67.1 M, counted half for the causal mask (33.6 M); LM head 1.05 G; x3 for the
    # backward: 48.25 GFLOP per token (51.5 with the whole attention matrix)
    per_token = num_floating_point_operations(shape(LLAMA3_8B), batch_size=1) / 4096
    assert per_token == pytest.approx(48.25e9, rel=0.002)


def test_tokens_from_the_batch_flags_else_the_counted_embedding():
    args = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--seq-length", "32"]
    assert tokens_per_step([*args, "--global-batch-size", "64"], 16, None)[0] == 64 * 32
    n, how = tokens_per_step(args, 16, embedded_tokens=256)  # a first-stage rank's replica share
    assert n == 256 * 4 and "data-parallel size 4" in how
    assert tokens_per_step(args, 16, None)[0] is None
    assert "tokens unknown" in tokens_per_step(args, 16, None)[1]


def test_a_shape_without_its_flags_is_unknown():
    assert shape(["--num-layers", "2"]) is None


def test_megatrons_own_count_for_a_step_the_capture_could_not_count():
    from integrations.megatron_workload import model_flops

    flops, how = model_flops([*LLAMA3_8B, "--global-batch-size", "8"], 64)
    assert flops == num_floating_point_operations(shape(LLAMA3_8B), batch_size=8) and "--global-batch-size 8" in how
    flops, how = model_flops(LLAMA3_8B, 64)
    assert flops is None and "--global-batch-size" in how
