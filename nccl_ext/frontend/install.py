"""Make a script's own ``init_process_group`` land on the prism process group.

``install(factory)`` registers the ``prism`` backend with torch and replaces
``torch.distributed.init_process_group`` so that whatever backend the script asks for
("nccl", "gloo", "cpu:gloo,cuda:nccl"), the default group becomes a
:class:`~nccl_ext.frontend.process_group.PrismProcessGroup` of the logical world. No store
rendezvous with the logical world happens (most of its ranks do not exist); the store
torch gets is process-local. ``dist.get_backend()`` reports the backend the script
asked for, so scripts that check for "nccl"/"gloo" keep working.

Checked against torch 2.13, which delegates ``dist.new_group`` to the default group's
``new_group`` method (so megatron's gloo subgroups also become prism groups). Older torch
(2.11 on the GPU machines) has no such delegation: every subgroup — whatever backend it asks
for — would go through ``_new_process_group_helper`` and create real gloo/NCCL groups whose
other members never come. There :func:`_intercept_subgroups` replaces that helper so that
subgroups of a prism world become prism groups, registered in torch's world state the way
the helper registers its own. ``install(subgroups=...)`` picks the path: ``"auto"`` (delegate
when this torch delegates), ``"delegate"`` (require it), ``"intercept"`` (the older torch's
path on any torch: the groups then have no ``new_group`` method, so torch creates subgroups
through the intercepted helper).

On the delegation path ``dist.new_group`` itself is wrapped (:func:`_answer_non_members`): a call
that does not include this rank — nearly all of them in a large world (393,245 of 393,266 for
TP2·PP2 at 65,536 ranks) — is answered here with what torch 2.13's ``_new_group_with_tag``
gives a non-member (``NON_GROUP_MEMBER``; ``None`` under ``use_local_synchronization``), after
the same checks and the one side effect it has on torch's state (``_world.group_count``, from
which later groups' names are numbered); the prism world still sees the call. Member calls,
and any call the wrapper does not recognise as plain, take torch's own path unchanged.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from nccl_ext.frontend import object_roots, safe_unpickle
from nccl_ext.frontend.process_group import DelegatingPrismProcessGroup, PrismProcessGroup, PrismWorld, Transport

BACKEND = "prism"
SUBGROUPS = ("auto", "delegate", "intercept")
"""How subgroups (``dist.new_group``) become prism groups: see the module docstring."""

_state: dict = {}


def current_world() -> PrismWorld | None:
    return _state.get("world")


def _physical_backend_name(requested) -> str:
    if requested is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    name = str(requested).lower()
    if ":" in name:  # "cpu:gloo,cuda:nccl"
        parts = dict(p.split(":", 1) for p in name.split(","))
        return parts.get("cuda", parts.get("cpu", "gloo"))
    return name


def install(
    *,
    rank: int,
    world_size: int,
    make_transport: Callable[[int, int, float], Transport],
    timeout_s: float,
    subgroups: str = "auto",
    restrict_objects: bool = False,
) -> None:
    """Patch ``torch.distributed`` for logical rank ``rank`` of ``world_size``; ``subgroups``
    (one of :data:`SUBGROUPS`) picks how ``dist.new_group`` reaches the prism world;
    ``restrict_objects``: object collectives unpickle through an allow-list only
    (:mod:`nccl_ext.frontend.safe_unpickle`: a trace its user did not sign)."""
    delegate = _subgroup_delegation(subgroups)
    if restrict_objects:
        safe_unpickle.install()
    if _state.get("installed"):
        return
    real_init = c10d.init_process_group

    def creator(opts, _backend_options=None):
        world = _state["world"]
        return world.make_group(tuple(range(world_size)), desc="default_pg")

    dist.Backend.register_backend(BACKEND, creator, extended_api=True, devices=["cpu", "cuda"])

    def init_process_group(backend=None, init_method=None, timeout=None, world_size_arg=-1, rank_arg=-1,
                           store=None, group_name="", pg_options=None, device_id=None, **kwargs):
        ws = kwargs.pop("world_size", world_size_arg)
        rk = kwargs.pop("rank", rank_arg)
        if ws not in (-1, None) and int(ws) != world_size:
            raise ValueError(
                f"init_process_group(world_size={ws}) but the logical world has {world_size} ranks "
                "(set by prism-launch's --nnodes x --nproc-per-node / target.world_size)"
            )
        if rk not in (-1, None) and int(rk) != rank:
            raise ValueError(f"init_process_group(rank={rk}) but this process is logical rank {rank}")
        if dist.is_initialized():
            raise RuntimeError("trying to initialize the default process group twice!")
        world = PrismWorld(rank=rank, world_size=world_size,
                           transport=make_transport(rank, world_size, timeout_s),
                           backend_name=_physical_backend_name(backend), delegates_new_group=delegate)
        _state["world"] = world
        object_roots.guard(lambda: getattr(world.transport, "captured", None), lambda: world.rank)
        # device_id is dropped on purpose: it would make NCCL split eagerly for every group.
        real_init(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                  timeout=timeout or datetime.timedelta(seconds=timeout_s), group_name=group_name)
        pg = c10d._get_default_group()
        _, pg_store = c10d._world.pg_map[pg]
        c10d._world.pg_map[pg] = (world.backend_name, pg_store)

    if not delegate:
        _intercept_subgroups()
    else:
        fast = _answer_non_members(c10d.new_group)
        c10d.new_group = fast
        dist.new_group = fast

    init_process_group.__doc__ = real_init.__doc__
    init_process_group.__wrapped__ = real_init
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
    _state["installed"] = True


def _subgroup_delegation(subgroups: str) -> bool:
    """Whether the default group takes ``dist.new_group`` itself (else torch's helper is intercepted)."""
    if subgroups not in SUBGROUPS:
        raise ValueError(f"subgroups must be one of {SUBGROUPS} (got {subgroups!r})")
    if subgroups == "intercept":
        return False
    delegates = _delegates_new_group()
    if subgroups == "delegate" and not delegates:
        raise RuntimeError(f"subgroups='delegate', but torch {torch.__version__} does not hand dist.new_group to the "
                           "default group; use 'auto' or 'intercept'")
    return delegates


def _delegates_new_group() -> bool:
    """Whether this torch hands ``new_group`` to the default group's own ``new_group``."""
    import inspect

    try:
        return "default_pg.new_group" in inspect.getsource(c10d._new_group_with_tag)
    except (OSError, TypeError, AttributeError):
        return False


def _answer_non_members(real_new_group):
    """``dist.new_group`` with non-member calls answered without torch's per-call bookkeeping
    (checked against torch 2.13's ``new_group``/``_new_group_with_tag``: for a non-member on the
    delegation path they validate the arguments, number the group's name, hand the call to the
    default group and return ``NON_GROUP_MEMBER``; under ``use_local_synchronization`` they
    return ``None`` before naming it). Whatever is not a plain non-member call — a member,
    ``ranks=None``, ``device_id``, ``sort_ranks=False``, torchcomms, an argument torch would
    refuse — goes to ``real_new_group``, which raises torch's own errors. One function on
    purpose: it runs ~400,000 times per rank at 65,536 ranks."""
    if not all(hasattr(c10d, n) for n in ("_world", "_get_default_timeout", "GroupMember")) or \
            not hasattr(c10d._world, "group_count"):
        return real_new_group  # internals this torch does not have: its own path for every call
    torchcomms = getattr(c10d, "_use_torchcomms_enabled", lambda: False)
    backends: dict[tuple, dist.Backend] = {}  # (asked, default) -> torch's Backend
    members, timedelta = c10d.GroupMember, datetime.timedelta

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                  group_desc=None, *more, **extra):
        if ranks is not None and not isinstance(ranks, (list, tuple, range)):
            try:  # an iterator is read once, here: torch's path then gets the list
                ranks = list(ranks)
            except TypeError:
                pass  # torch's path reports it
        world = _state.get("world")
        default_pg = members.WORLD
        if (world is None or ranks is None or more
                or (extra and (extra.get("device_id") is not None or extra.get("sort_ranks", True) is not True))
                or not isinstance(default_pg, DelegatingPrismProcessGroup) or torchcomms()):
            return real_new_group(ranks, timeout, backend, pg_options, use_local_synchronization, group_desc,
                                  *more, **extra)
        try:
            ordered = sorted(ranks)
            plain = bool(ordered) and world.rank not in ordered
            if plain:
                asked = (backend, c10d._world.pg_map[default_pg][0])
                resolved = backends.get(asked) if backend is None or type(backend) is str else None
                if resolved is None:
                    resolved = backends[asked] = dist.Backend(backend or asked[1])
                if timeout is None:
                    c10d._get_default_timeout(resolved)  # (warns as torch does for nccl on a build without it)
                else:
                    plain = isinstance(timeout, timedelta)
            if plain and use_local_synchronization:
                if resolved != dist.Backend.MPI:
                    return None  # torch returns before naming the group or asking the default group
                plain = False
            size = world.world_size
            plain = plain and len(ordered) <= size and ordered[0] >= 0 and ordered[-1] < size \
                and len(set(ordered)) == len(ordered)
        except Exception:  # noqa: BLE001 - anything unexpected (a newer torch's internals) takes torch's path
            plain = False
        if not plain:
            return real_new_group(ranks, timeout, backend, pg_options, use_local_synchronization, group_desc,
                                  *more, **extra)
        c10d._world.group_count += 1  # torch's _process_group_name: the next group's name is one higher
        world.make_group(ordered, group_desc or "")
        return members.NON_GROUP_MEMBER

    new_group.__doc__ = real_new_group.__doc__
    new_group.__wrapped__ = real_new_group
    return new_group


def _intercept_subgroups() -> None:
    real_helper = c10d._new_process_group_helper
    names = inspect_params(real_helper)[6:]  # keyword names of the optional parameters

    def helper(group_size, group_rank, global_ranks_in_group, backend, store, group_name, *args, **kwargs):
        world = _state.get("world")
        if world is None or not global_ranks_in_group or c10d.GroupMember.WORLD is None:
            return real_helper(group_size, group_rank, global_ranks_in_group, backend, store, group_name,
                               *args, **kwargs)
        kw = dict(zip(names, args)) | kwargs
        pg = world.make_group(global_ranks_in_group, desc=kw.get("group_desc") or "", name=str(group_name))
        if pg is None:
            return c10d.GroupMember.NON_GROUP_MEMBER, None
        prefix_store = dist.PrefixStore(f"{group_name}/", store)
        w = c10d._world
        w.pg_map[pg] = (world.backend_name, prefix_store)
        w.pg_names[pg] = group_name
        if hasattr(c10d, "_register_process_group"):
            c10d._register_process_group(group_name, pg)
        if hasattr(w, "pg_backend_config"):
            w.pg_backend_config[pg] = str(world.backend_name)
        pg_tag = kw.get("pg_tag") or f"ptd:{group_name}"
        if hasattr(w, "tags_to_pg"):
            w.tags_to_pg.setdefault(pg_tag, []).append(pg)
            w.pg_to_tag[pg] = pg_tag
        return pg, prefix_store

    c10d._new_process_group_helper = helper


def inspect_params(fn) -> list[str]:
    import inspect

    return list(inspect.signature(fn).parameters)


def install_step_marker(on_step: Callable[[], None]):
    """Call ``on_step`` once per training iteration: after every step of the lead optimizer, the
    first torch optimizer that steps (torch's global post hook), while it lives. A framework that
    steps several torch optimizers an iteration steps the lead once an iteration too: Megatron's
    chained optimizers (dense, then expert parameters), with the distributed optimizer's
    parameter all-gathers between their steps. Returns the hook's handle."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    lead: list[weakref.ref] = []

    def hook(optimizer, *_) -> None:
        if not lead or lead[0]() is None:  # the first to step, or the lead was dropped
            lead[:] = [weakref.ref(optimizer)]
        if lead[0]() is optimizer:
            on_step()

    return register_optimizer_step_post_hook(hook)


def close() -> None:
    world = _state.get("world")
    if world is not None:
        world.transport.close()


__all__ = ["BACKEND", "SUBGROUPS", "PrismProcessGroup", "close", "current_world", "install", "install_step_marker"]
