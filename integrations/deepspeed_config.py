"""``target.parallel`` rendered into a DeepSpeed JSON config (``integration.kind=deepspeed``).

The config the script is given through ``--deepspeed_config``/``--deepspeed-config`` (or
``--deepspeed_config=PATH``) is read, and a rendered copy is written to the run's output dir
(``integration.render_dir``); the script argument is pointed at the copy. Keys written:

- ``train_micro_batch_size_per_gpu`` (micro_batch_size), ``train_batch_size``
  (global_batch_size) and ``gradient_accumulation_steps``, kept consistent:
  ``train_batch_size = micro x accumulation x dp`` with ``dp = world / (tp x pp x cp)``;
- ``pipeline.stages`` (pp), when pp is set;
- ``moe.ep_size`` (ep): DeepSpeed takes the expert-parallel size in code
  (``deepspeed.moe.layer.MoE(ep_size=...)``), so recipes read it from this key of their config;
- ``tensor_parallel.autotp_size`` (tp), only when the config already has a
  ``tensor_parallel`` section (DeepSpeed AutoTP training).
- ``zero_optimization.stage`` (zero_stage); DeepSpeed's pipeline engine takes ZeRO stage 0
  or 1 only, so a stage above 1 with more than one pipeline stage is an error.

The bundled recipes (``examples/deepspeed_*.py``) read ``pipeline.stages`` and
``moe.ep_size`` from the config they are given, so what is rendered is what runs.

Fields that a recipe takes as flags (Megatron-DeepSpeed's ``--tensor-model-parallel-size``...)
are also rendered as flags when ``integration.flags.<field>`` names them. ``script.args``
applies as for Megatron recipes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from integrations.megatron_flags import FIELDS, get_flag, render_script_args, set_flag
from prism_launch.config import ConfigError

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config")


def _known(v):
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def render_config(ds: dict, world: int, parallel) -> dict:
    """A copy of ``ds`` with ``parallel`` (a ParallelConfig) rendered; raises ConfigError."""
    ds = json.loads(json.dumps(ds))
    tp, pp, cp = parallel.tp or 1, parallel.pp or 1, parallel.cp or 1
    if "pipeline" in ds and parallel.pp is None and _known(ds["pipeline"].get("stages")):
        pp = ds["pipeline"]["stages"]
    if world % (tp * pp * cp):
        raise ConfigError(f"target.parallel.tp x pp x cp = {tp}x{pp}x{cp} does not divide the world of {world} ranks")
    dp = world // (tp * pp * cp)
    mbs = parallel.micro_batch_size or _known(ds.get("train_micro_batch_size_per_gpu"))
    gbs = parallel.global_batch_size
    gas = _known(ds.get("gradient_accumulation_steps"))
    if gbs is None and parallel.micro_batch_size is None:
        gbs = _known(ds.get("train_batch_size"))
    if gbs is None and mbs is not None:
        gbs = mbs * (gas or 1) * dp
    if mbs is None and gbs is not None:
        if gbs % ((gas or 1) * dp):
            raise ConfigError(f"target.parallel.global_batch_size={gbs} is not divisible by gradient accumulation "
                              f"{gas or 1} x data-parallel size {dp}")
        mbs = gbs // ((gas or 1) * dp)
    if mbs is not None and gbs is not None:
        if gbs % (mbs * dp):
            raise ConfigError(f"target.parallel.global_batch_size={gbs} must be divisible by micro_batch_size={mbs} "
                              f"x data-parallel size {dp}")
        ds["train_micro_batch_size_per_gpu"] = mbs
        ds["train_batch_size"] = gbs
        ds["gradient_accumulation_steps"] = gbs // (mbs * dp)
    if parallel.pp is not None:
        ds["pipeline"] = {**ds.get("pipeline", {}), "stages": parallel.pp}
    if parallel.ep is not None:
        if dp * cp % parallel.ep:
            raise ConfigError(f"target.parallel.ep={parallel.ep} must divide data-parallel x context-parallel "
                              f"size {dp}x{cp}")
        ds["moe"] = {**ds.get("moe", {}), "ep_size": parallel.ep}
    if parallel.zero_stage is not None:
        ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": parallel.zero_stage}
    stage = ds.get("zero_optimization", {}).get("stage")
    if pp > 1 and _known(stage) is not None and stage > 1:
        field = "target.parallel.zero_stage" if parallel.zero_stage is not None else "zero_optimization.stage"
        raise ConfigError(f"{field}={stage}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only "
                          f"(pipeline.stages={pp})")
    if parallel.tp is not None and isinstance(ds.get("tensor_parallel"), dict):
        ds["tensor_parallel"] = {**ds["tensor_parallel"], "autotp_size": parallel.tp}
    return ds


def config_path(args: list[str]) -> tuple[str, str] | None:
    for flag in CONFIG_FLAGS:
        v = get_flag(args, flag)
        if isinstance(v, str):
            return flag, v
    return None


def render(cfg, script_args: list[str], out_dir=None) -> list[str]:
    args = list(script_args)
    found = config_path(args)
    if found is None:
        raise ConfigError("integration.kind=deepspeed: the script args pass no --deepspeed_config/--deepspeed-config")
    flag, path = found
    src = Path(path)
    try:
        ds = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"integration.kind=deepspeed: cannot read {flag} {path}: {e}") from None
    rendered = render_config(ds, int(cfg.target.world_size), cfg.target.parallel)
    if rendered != ds:
        text = json.dumps(rendered, indent=1, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        out = Path(cfg.integration.render_dir or out_dir or "prism_rendered").resolve()
        out.mkdir(parents=True, exist_ok=True)
        dst = out / f"{src.stem}.{digest}.json"
        if not dst.exists():
            from nccl_ext.core.atomic import atomic_write_text

            atomic_write_text(dst, text)
        args = set_flag(args, flag, str(dst))
    for f in FIELDS:  # recipe flags named explicitly (e.g. Megatron-DeepSpeed)
        name = getattr(cfg.integration.flags, f)
        if name:
            args = set_flag(args, name, getattr(cfg.target.parallel, f))
    return render_script_args(cfg, args)
