"""``target.parallel`` and ``script.args`` rendered into a Megatron-style recipe's flags,
and Megatron's rules on parallel sizes checked before anything runs.

Megatron-LM's standard flag names by default; a recipe with its own names sets
``integration.flags.<field>=--its-flag``. A flag already in the script args is replaced in
place (``--flag value`` and ``--flag=value``, dash or underscore spelling); otherwise it is
appended. Imports nothing from Megatron: the rules below mirror megatron-core 0.16's
``initialize_model_parallel`` and ``TransformerConfig`` checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from prism_launch.config import ConfigError

FIELDS = ("tp", "pp", "ep", "cp", "etp", "micro_batch_size", "global_batch_size")

DEFAULT_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "ep": "--expert-model-parallel-size",
    "cp": "--context-parallel-size",
    "etp": "--expert-tensor-parallel-size",
    "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size",
}

# Megatron-LM's model flags the checks read when the recipe passes them.
MODEL_FLAGS = {
    "num_layers": "--num-layers",
    "num_attention_heads": "--num-attention-heads",
    "num_experts": "--num-experts",
    "seq_length": "--seq-length",
}

_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _spellings(flag: str) -> tuple[str, ...]:
    """``--a-b`` and ``--a_b`` name the same flag in the script args."""
    body = flag.lstrip("-")
    prefix = flag[: len(flag) - len(body)]
    return tuple(dict.fromkeys((flag, prefix + body.replace("_", "-"), prefix + body.replace("-", "_"))))


def _is_value(tok: str) -> bool:
    return not tok.startswith("-") or bool(_NUMBER.match(tok))


def _occurrences(args: list[str], flag: str) -> list[tuple[int, bool]]:
    """``(index, inline)`` of every occurrence of ``flag`` (``inline``: ``--flag=value``)."""
    names = _spellings(flag)
    out = []
    for i, tok in enumerate(args):
        if tok in names:
            out.append((i, False))
        elif "=" in tok and tok.split("=", 1)[0] in names:
            out.append((i, True))
    return out


def get_flag(args: list[str], flag: str) -> str | bool | None:
    """The last value given to ``flag`` (argparse's rule); True for a bare flag; None if absent."""
    occ = _occurrences(args, flag)
    if not occ:
        return None
    i, inline = occ[-1]
    if inline:
        return args[i].split("=", 1)[1]
    if i + 1 < len(args) and _is_value(args[i + 1]):
        return args[i + 1]
    return True


def _tokens(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def set_flag(args: list[str], flag: str, value: Any) -> list[str]:
    """``args`` with ``flag`` set to ``value``: replaced where it occurs, else appended.

    None leaves ``args`` alone; True makes a bare flag present; False removes the flag (and
    the value that follows it, if any); a list gives several values (``nargs``).
    """
    if value is None:
        return list(args)
    occ = _occurrences(args, flag)
    if value is False:
        drop = set()
        for i, inline in occ:
            drop.add(i)
            if not inline and i + 1 < len(args) and _is_value(args[i + 1]):
                drop.add(i + 1)
        return [t for k, t in enumerate(args) if k not in drop]
    if value is True:
        return list(args) if occ else [*args, flag]
    vals = _tokens(value)
    if not occ:
        return [*args, flag, *vals]
    out, k = [], 0
    starts = {i: inline for i, inline in occ}
    while k < len(args):
        if k in starts:
            name = args[k].split("=", 1)[0]
            if starts[k]:
                out.append(f"{name}={vals[0]}" if len(vals) == 1 else name)
                if len(vals) > 1:
                    out.extend(vals)
                k += 1
            else:
                out.extend([name, *vals])
                k += 1
                # the old value: one token, or every value token when a list replaces it
                while k < len(args) and _is_value(args[k]) and k not in starts:
                    k += 1
                    if not isinstance(value, (list, tuple)):
                        break
            continue
        out.append(args[k])
        k += 1
    return out


def flag_names(cfg) -> dict[str, str]:
    """The recipe's flag for each ``target.parallel`` field."""
    return {f: getattr(cfg.integration.flags, f) or DEFAULT_FLAGS[f] for f in FIELDS}


def script_flag(key: str) -> str:
    """``script.args`` key to flag: ``moe_router_topk`` -> ``--moe-router-topk`` (a key that
    starts with ``-`` is used as written)."""
    return key if key.startswith("-") else "--" + key.replace("_", "-")


def render_script_args(cfg, args: list[str]) -> list[str]:
    for key, value in (cfg.script.args or {}).items():
        args = set_flag(args, script_flag(key), value)
    return args


def render_parallel(cfg, args: list[str], fields=FIELDS) -> list[str]:
    names = flag_names(cfg)
    for f in fields:
        args = set_flag(args, names[f], getattr(cfg.target.parallel, f))
    return args


def render(cfg, script_args: list[str], out_dir=None) -> list[str]:
    """The script args with ``target.parallel`` and ``script.args`` rendered; validated."""
    args = render_parallel(cfg, list(script_args))
    args = render_script_args(cfg, args)
    validate(cfg, args)
    return args


# -- validation --------------------------------------------------------------------------


@dataclass(slots=True)
class Sizes:
    tp: int
    pp: int
    ep: int
    cp: int
    etp: int
    micro_batch_size: int | None
    global_batch_size: int | None
    num_layers: int | None
    num_attention_heads: int | None
    num_experts: int | None
    seq_length: int | None
    source: dict[str, str]
    """Field -> where its value came from (``target.parallel.tp`` or the flag name)."""
    given: dict[str, bool]
    """Field -> whether the script args pass it (else Megatron's default)."""


def _int(v, where: str) -> int | None:
    if v is None or v is True:
        return None
    try:
        return int(str(v))
    except ValueError:
        raise ConfigError(f"{where}: expected an integer, got {v!r}") from None


def sizes(cfg, args: list[str]) -> Sizes:
    """Effective sizes of the (rendered) script args, with Megatron's defaults."""
    names = flag_names(cfg)
    vals, source = {}, {}
    for f in FIELDS:
        set_by_cfg = getattr(cfg.target.parallel, f) is not None
        source[f] = f"target.parallel.{f}" if set_by_cfg else names[f]
        vals[f] = _int(get_flag(args, names[f]), source[f])
    for f, flag in MODEL_FLAGS.items():
        source[f] = flag
        vals[f] = _int(get_flag(args, flag), source[f])
    tp = vals["tp"] or 1
    return Sizes(tp=tp, pp=vals["pp"] or 1, ep=vals["ep"] or 1, cp=vals["cp"] or 1, etp=vals["etp"] or tp,
                 micro_batch_size=vals["micro_batch_size"], global_batch_size=vals["global_batch_size"],
                 num_layers=vals["num_layers"], num_attention_heads=vals["num_attention_heads"],
                 num_experts=vals["num_experts"], seq_length=vals["seq_length"], source=source,
                 given={f: v is not None for f, v in vals.items()})


def _blame(s: Sizes, *fields: str) -> str:
    """Name the fields at fault: those set by ``target.parallel`` first, then script flags."""
    cfg_set = [f for f in fields if s.source[f].startswith("target.parallel.")]
    named = cfg_set or [f for f in fields if s.given.get(f)] or list(fields[:1])
    return ", ".join(f"{s.source[f].split(' ')[0]}={getattr(s, f)}" for f in named)


def check(world: int, s: Sizes) -> None:
    """Megatron's rules; the ConfigError names the field(s) at fault."""
    for f in ("tp", "pp", "ep", "cp", "etp"):
        if getattr(s, f) < 1:
            raise ConfigError(f"{_blame(s, f)}: must be >= 1")
    model = s.tp * s.pp * s.cp
    if world % model:
        raise ConfigError(f"{_blame(s, 'tp', 'pp', 'cp')}: tp x pp x cp = {s.tp}x{s.pp}x{s.cp} = {model} does not "
                          f"divide the world of {world} ranks")
    dp = world // model
    expert = s.etp * s.ep * s.pp
    if world % expert:
        if s.etp == s.tp:
            raise ConfigError(f"{_blame(s, 'ep', 'tp', 'pp')}: ep={s.ep} must divide data-parallel x context-parallel "
                              f"size {dp}x{s.cp}={dp * s.cp} (world {world} not divisible by tp x ep x pp = {expert})")
        raise ConfigError(f"{_blame(s, 'etp', 'ep', 'pp')}: etp x ep x pp = {s.etp}x{s.ep}x{s.pp} = {expert} does "
                          f"not divide the world of {world} ranks")
    if s.num_experts is not None and s.num_experts % s.ep:
        raise ConfigError(f"{_blame(s, 'ep')}: must divide --num-experts={s.num_experts}")
    if s.num_attention_heads is not None and s.num_attention_heads % s.tp:
        raise ConfigError(f"{_blame(s, 'tp')}: must divide --num-attention-heads={s.num_attention_heads}")
    if s.num_layers is not None and s.num_layers % s.pp:
        raise ConfigError(f"{_blame(s, 'pp')}: must divide --num-layers={s.num_layers}")
    if s.seq_length is not None and s.cp > 1 and s.seq_length % (2 * s.cp):
        raise ConfigError(f"{_blame(s, 'cp')}: --seq-length={s.seq_length} must be divisible by 2 x cp")
    mbs, gbs = s.micro_batch_size, s.global_batch_size
    if mbs is not None and gbs is not None and gbs % (mbs * dp):
        raise ConfigError(f"{_blame(s, 'global_batch_size', 'micro_batch_size')}: global batch {gbs} must be "
                          f"divisible by micro batch {mbs} x data-parallel size {dp}")


def validate(cfg, args: list[str]) -> None:
    check(int(cfg.target.world_size), sizes(cfg, args))


GPU_WAITS_AGAINST = {
    "--num-experts": "MoE: Megatron's token dispatchers copied routing counts to pageable host memory right "
                     "after their collectives, and such a copy behind a wait on the GPU held the CUDA "
                     "driver's lock that the wait's fold needs (H200: the MoE PP2·EP2 capture stopped there); "
                     "the capture now makes those copies into pinned memory (integrations.megatron_probe), "
                     "not yet measured on a GPU: capture.gpu_waits=true opts in",
}
"""Flags whose programs stop with waits on the GPU, and why."""


def gpu_waits(script_args: list[str]) -> tuple[bool, str] | None:
    """The registry's ``waits`` role: against where a flag of :data:`GPU_WAITS_AGAINST` is given,
    for a Megatron-LM training recipe (``--num-layers`` given) without one, no word otherwise."""
    for flag, why in GPU_WAITS_AGAINST.items():
        if get_flag(script_args, flag) not in (None, False):
            return False, f"{flag}: {why}"
    if get_flag(script_args, "--num-layers") is not None:
        return True, ("a Megatron-LM recipe without MoE (H200, upstream pretrain_gpt.py's dense TP2·PP2 job: "
                      "capture 1.7–2.2x its emulated step with them, 2.8–3.9x without)")
    return None
