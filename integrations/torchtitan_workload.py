"""What one training step of a torchtitan recipe processes, read as torchtitan reads it: the
TOML file of ``--job.config_file`` first, then the command line's ``--section.field`` options
(either spelling, ``local_batch_size`` or ``local-batch-size``), then torchtitan's defaults
(config/job_config.py of 0.2.2).

Tokens per step are ``--training.global_batch_size`` × ``--training.seq_len`` where the global
batch is set, else ``local_batch_size`` × data-parallel degree × ``seq_len``, the data-parallel
degree being ``dp_replicate × dp_shard`` with a ``dp_shard`` of -1 filled in as torchtitan does
(``world / (dp_replicate × cp × tp × pp)``). Tokens per second per GPU are then what
torchtitan logs as ``tps`` (a rank's tokens over its step, divided by the non-data-parallel
size).
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass

from integrations.megatron_flags import get_flag

__all__ = ["Batch", "batch", "model_flops", "tokens_per_step"]

DEFAULTS = {("training", "local_batch_size"): 8, ("training", "global_batch_size"): -1,
            ("training", "seq_len"): 2048, ("parallelism", "data_parallel_replicate_degree"): 1,
            ("parallelism", "data_parallel_shard_degree"): -1, ("parallelism", "tensor_parallel_degree"): 1,
            ("parallelism", "pipeline_parallel_degree"): 1, ("parallelism", "context_parallel_degree"): 1}
"""torchtitan 0.2.2's defaults for the fields read here."""

CONFIG_FILE = ("--job.config_file", "--job.config-file")


@dataclass(frozen=True, slots=True)
class Batch:
    """The batch and parallel sizes of a torchtitan job, as it resolves them."""

    local_batch_size: int
    global_batch_size: int
    seq_len: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard


def _toml(args: list[str]) -> dict:
    for flag in CONFIG_FILE:
        path = get_flag(args, flag)
        if isinstance(path, str):
            try:
                with open(path, "rb") as f:
                    return tomllib.load(f)
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ValueError(f"{flag} {path}: cannot read it as TOML ({e})") from None
    return {}


def _int(args: list[str], toml: dict, section: str, field: str) -> int:
    for name in (f"--{section}.{field}", f"--{section}.{field.replace('_', '-')}"):
        v = get_flag(args, name)
        if v is not None and not isinstance(v, bool):
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"{name} must be an integer (got {v!r})") from None
    v = (toml.get(section) or {}).get(field)
    return int(v) if v is not None else DEFAULTS[(section, field)]


def batch(args: list[str], world_size: int) -> Batch:
    """The job's batch and parallel sizes; ValueError where they do not fit ``world_size``."""
    toml = _toml(args)
    par = {f: _int(args, toml, "parallelism", f"{f}_degree") for f in
           ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel", "pipeline_parallel",
            "context_parallel")}
    rep, tp, pp, cp = (par["data_parallel_replicate"], par["tensor_parallel"], par["pipeline_parallel"],
                       par["context_parallel"])
    shard = par["data_parallel_shard"]
    if shard < 0:
        if world_size % (rep * tp * pp * cp):
            raise ValueError(f"dp_replicate {rep} x tp {tp} x pp {pp} x cp {cp} does not divide the world of "
                             f"{world_size} ranks")
        shard = world_size // (rep * tp * pp * cp)
    local = _int(args, toml, "training", "local_batch_size")
    gbs = _int(args, toml, "training", "global_batch_size")
    dp = rep * shard
    return Batch(local_batch_size=local, global_batch_size=gbs if gbs > 0 else local * dp,
                 seq_len=_int(args, toml, "training", "seq_len"), dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp,
                 cp=cp)


def tokens_per_step(args: list[str], world_size: int, embedded_tokens: int | None) -> tuple[int | None, str]:
    """Tokens the whole job trains on per step, and how that was found."""
    try:
        b = batch(args, world_size)
    except ValueError as e:
        return None, f"tokens unknown ({e})"
    how = ("--training.global_batch_size" if b.global_batch_size != b.local_batch_size * b.data_parallel
           else f"--training.local_batch_size {b.local_batch_size} × data-parallel degree {b.data_parallel}")
    return b.global_batch_size * b.seq_len, f"{how} × --training.seq_len {b.seq_len} (torchtitan's options)"


def model_flops(args: list[str], world_size: int) -> tuple[float | None, str]:
    """Model FLOPs of one step of the whole job by torchtitan's own count (its trainer's: the
    model's ``get_nparams_and_flops`` on a meta-device instance — 6 × non-embedding parameters
    plus attention, per token — times the tokens of a step), for programs whose FLOPs the capture
    could not count (torch.compile'd ones). The job's options are parsed by torchtitan's own
    ``ConfigManager``; None, with why, where torchtitan cannot say."""
    try:
        b = batch(args, world_size)
        from integrations import torchtitan_compat

        torchtitan_compat.install()  # importing torchtitan needs its Triton stand-in on a CPU torch
        import torch
        from torchtitan.config import ConfigManager
        from torchtitan.protocols.train_spec import get_train_spec

        job = ConfigManager().parse_args(list(args))
        spec = get_train_spec(job.model.name)
        model_args = copy.deepcopy(spec.model_args[job.model.flavor])  # the registry's own stays as it is
        model_args.update_from_config(job)
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        _, per_token = model_args.get_nparams_and_flops(model, job.training.seq_len)
    except Exception as e:  # noqa: BLE001 - a figure the report then calls unknown, saying why
        return None, f"torchtitan's own count failed: {type(e).__name__}: {e}"
    tokens = b.global_batch_size * b.seq_len
    return float(per_token) * tokens, (f"torchtitan's own count: {per_token:,} FLOPs per token "
                                       f"(get_nparams_and_flops, as its trainer reports MFU) × {tokens:,} tokens")
