"""``target.parallel`` and ``script.args`` rendered into torchtitan's flags
(``integration.kind=torchtitan``).

torchtitan takes its parallel sizes as ``--parallelism.*`` options (config/job_config.py of
0.2.2): tp, pp, cp, ep, etp and the batch sizes map to the flags below. Its data-parallel
shard degree defaults to ``-1`` (whatever the other dimensions leave); when a model-parallel
size is rendered, ``--parallelism.data_parallel_shard_degree`` is rendered as
``world / (tp x pp x cp x dp_replicate)`` so a degree the script passes stays consistent with
the new sizes. An explicit ``integration.flags.<field>`` overrides a flag name.
"""

from __future__ import annotations

from integrations.megatron_flags import FIELDS, get_flag, render_script_args, set_flag
from prism_launch.config import ConfigError

DEFAULT_FLAGS = {
    "tp": "--parallelism.tensor_parallel_degree",
    "pp": "--parallelism.pipeline_parallel_degree",
    "ep": "--parallelism.expert_parallel_degree",
    "cp": "--parallelism.context_parallel_degree",
    "etp": "--parallelism.expert_tensor_parallel_degree",
    "micro_batch_size": "--training.local_batch_size",
    "global_batch_size": "--training.global_batch_size",
}
DP_SHARD = "--parallelism.data_parallel_shard_degree"
DP_REPLICATE = "--parallelism.data_parallel_replicate_degree"


def _size(args: list[str], flag: str, default: int) -> int:
    v = get_flag(args, flag)
    if v is None or v is True:
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"integration.kind=torchtitan: {flag} {v!r} is not an integer") from None


def render(cfg, script_args: list[str], out_dir=None) -> list[str]:
    """The script args with ``target.parallel`` and ``script.args`` rendered; raises
    ConfigError when the model-parallel sizes do not divide the world."""
    args = list(script_args)
    par = cfg.target.parallel
    for f in FIELDS:
        name = getattr(cfg.integration.flags, f) or DEFAULT_FLAGS[f]
        args = set_flag(args, name, getattr(par, f))
    if any(getattr(par, f) is not None for f in ("tp", "pp", "cp")):
        world = int(cfg.target.world_size)
        model = (_size(args, DEFAULT_FLAGS["tp"], 1) * _size(args, DEFAULT_FLAGS["pp"], 1)
                 * _size(args, DEFAULT_FLAGS["cp"], 1) * _size(args, DP_REPLICATE, 1))
        if world % model:
            raise ConfigError(f"target.parallel: tp x pp x cp x dp_replicate = {model} does not divide the world of "
                              f"{world} ranks")
        args = set_flag(args, DP_SHARD, world // model)
    return render_script_args(cfg, args)
