"""torchtitan's tokens per step, resolved as torchtitan resolves its options: the TOML of
--job.config_file, then the command line (either spelling), then its defaults; a data-parallel
shard degree of -1 is what the other dimensions leave of the world."""

import pytest

from integrations.torchtitan_workload import batch, tokens_per_step
from prism_launch.config.registry import load


def test_defaults_fill_the_shard_degree_from_the_world():
    b = batch(["--model.name", "llama3", "--parallelism.tensor_parallel_degree", "2"], 16)
    assert (b.dp_shard, b.tp, b.local_batch_size, b.seq_len, b.global_batch_size) == (8, 2, 8, 2048, 64)
    n, how = tokens_per_step(["--parallelism.tensor_parallel_degree", "2"], 16, None)
    assert n == 8 * 8 * 2048 and "data-parallel degree 8" in how


def test_toml_then_command_line_either_spelling(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("[training]\nlocal_batch_size = 2\nseq_len = 8192\n[parallelism]\ndata_parallel_replicate_degree = 2\n"
                   "pipeline_parallel_degree = 2\n")
    args = ["--job.config_file", str(cfg), "--training.seq-len=4096"]
    b = batch(args, 64)
    assert (b.dp_replicate, b.dp_shard, b.pp, b.seq_len, b.local_batch_size) == (2, 16, 2, 4096, 2)
    assert tokens_per_step(args, 64, None)[0] == 2 * 32 * 4096


def test_published_fsdp_row_global_batch():
    """torchtitan's published Llama 3.1 8B row: 8 GPUs, FSDP, local batch 2, seq 8192: 16 sequences."""
    args = ["--training.local_batch_size", "2", "--training.seq_len", "8192"]
    assert tokens_per_step(args, 8, None)[0] == 16 * 8192
    n, how = tokens_per_step([*args, "--training.global_batch_size", "32"], 8, None)
    assert n == 32 * 8192 and "global_batch_size" in how


def test_sizes_that_do_not_fit_say_so(tmp_path):
    n, how = tokens_per_step(["--parallelism.tensor_parallel_degree", "3"], 8, None)
    assert n is None and "does not divide the world of 8" in how
    with pytest.raises(ValueError, match="must be an integer"):
        batch(["--training.local_batch_size", "two"], 8)
    with pytest.raises(ValueError, match="cannot read it as TOML"):
        batch(["--job.config_file", str(tmp_path / "missing.toml")], 8)


def test_registered_as_torchtitans_workload():
    assert load("torchtitan", "workload", where="t").tokens_per_step is tokens_per_step


def test_torchtitans_own_flop_count():
    """For programs the capture cannot count (torch.compile'd): torchtitan's trainer's own count
    (get_nparams_and_flops on a meta-device model) times the step's tokens."""
    from importlib.util import find_spec

    if find_spec("torchtitan") is None or find_spec("tokenizers") is None:
        pytest.skip("torchtitan is not installed (pip install 'prism-launch[torchtitan]')")
    from integrations.torchtitan_workload import model_flops

    args = ["--model.name", "llama3", "--model.flavor", "8B", "--training.local_batch_size", "2",
            "--training.seq_len", "8192"]
    flops, how = model_flops(args, 8)
    # Llama 3.1 8B: 8,030,261,248 parameters, less the token embedding (128,256 x 4,096); attention:
    # 6 x layers x heads x (q+v head dims) x seq
    per_token = 6 * (8_030_261_248 - 128_256 * 4_096) + 6 * 32 * 32 * 256 * 8192
    assert flops == per_token * 16 * 8192, how
    assert "torchtitan's own count" in how
    flops, how = model_flops(["--model.name", "llama3", "--model.flavor", "no-such-flavor"], 8)
    assert flops is None and "no-such-flavor" in how
