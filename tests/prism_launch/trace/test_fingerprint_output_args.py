"""What keys a trace: Megatron-LM's ``--wandb-*`` flags and DeepSpeed recipes' ``--output_dir``-style
flags are output-only — their values never change the trace's fingerprint (a trace captured with
one W&B run name or output folder is emulated with another) — while their presence, and every
other flag's value, still does."""

from __future__ import annotations

import pytest

from prism_launch.config.registry import output_args
from prism_launch.launch.args import mask_output_args
from prism_launch.trace import fingerprint as fp

MEGATRON = ["--num-layers", "2", "--hidden-size", "64"]
DEEPSPEED = ["--deepspeed", "--deepspeed_config", "ds.json"]


@pytest.fixture
def key(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")

    def key(args: list[str], *, extra: tuple[str, ...] = ()) -> str:
        """The trace key of a run of ``train.py args`` (as the launcher computes it)."""
        keyed = mask_output_args(list(args), output_args(extra))
        return fp.combined(fp.fingerprint(program_config={"device": "cpu"}, script=str(script), module=False,
                                          args=keyed))

    return key


@pytest.mark.parametrize("flag", ["--wandb-project", "--wandb-exp-name", "--wandb-save-dir"])
def test_megatron_wandb_values_do_not_key_the_trace(key, flag):
    assert key([*MEGATRON, flag, "run-a"]) == key([*MEGATRON, flag, "run-b"])
    assert key([*MEGATRON, f"{flag}=run-a"]) == key([*MEGATRON, f"{flag}=run-b"])


def test_every_wandb_flag_together_with_save_and_tensorboard(key):
    a = [*MEGATRON, "--wandb-project", "p1", "--wandb-exp-name", "e1", "--wandb-save-dir", "/tmp/w1",
         "--save", "/ckpt/1", "--tensorboard-dir", "/tb/1"]
    b = [*MEGATRON, "--wandb-project", "p2", "--wandb-exp-name", "e2", "--wandb-save-dir", "/tmp/w2",
         "--save", "/ckpt/2", "--tensorboard-dir", "/tb/2"]
    assert key(a) == key(b)


@pytest.mark.parametrize("flag", ["--output_dir", "--output-dir", "--save_dir", "--logging_dir", "--log_dir",
                                  "--tensorboard_dir", "--job_name", "--run_name"])
def test_deepspeed_output_only_values_do_not_key_the_trace(key, flag):
    assert key([*DEEPSPEED, flag, "/out/a"]) == key([*DEEPSPEED, flag, "/out/b"])
    assert key([*DEEPSPEED, f"{flag}=/out/a"]) == key([*DEEPSPEED, f"{flag}=/out/b"])


def test_presence_of_an_output_flag_still_keys_the_trace(key):
    assert key([*MEGATRON, "--wandb-project", "p"]) != key(MEGATRON)
    assert key([*DEEPSPEED, "--output_dir", "/out"]) != key(DEEPSPEED)


def test_a_shaping_flag_beside_an_output_flag_still_keys_the_trace(key):
    # the value after an output flag is masked, not the flag that follows it
    assert key([*DEEPSPEED, "--output_dir", "/o", "--train_batch_size", "8"]) != \
        key([*DEEPSPEED, "--output_dir", "/o", "--train_batch_size", "16"])
    assert key(["--num-layers", "2", "--wandb-project", "p"]) != key(["--num-layers", "4", "--wandb-project", "p"])
    # a value-less output flag followed by another flag: that flag and its value are kept
    assert key(["--wandb-save-dir", "--num-layers", "2"]) != key(["--wandb-save-dir", "--num-layers", "4"])


def test_trace_ignore_args_adds_the_recipes_own_output_flags(key):
    assert key(["--out", "/a"]) != key(["--out", "/b"])
    assert key(["--out", "/a"], extra=("--out",)) == key(["--out", "/b"], extra=("--out",))
