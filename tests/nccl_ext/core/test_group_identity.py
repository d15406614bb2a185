"""Group identity through ``dist.new_group``: every member group's key is the reference
``size:blake2b(repr(ranks)):occurrence`` and every call — member or not, answered by the
non-member shortcut of ``install`` or by torch's own path — gives the same results, group names,
torch state (``_world.group_count``, rank mappings), discovery record and errors. Each case
runs in a fresh interpreter (``install`` patches torch for the process)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest

from nccl_ext.frontend import install
from tests.conftest import ROOT, _env

WORLD = 16
TP, PP = 2, 2
DP = WORLD // (TP * PP)


def _layout() -> list[list[int]]:
    """A megatron-like TP2·PP2 layout of 16 ranks (tp-dp-pp order), with repeats."""
    tp = [list(range(s, s + TP)) for s in range(0, WORLD, TP)]
    dp = [[t + TP * d + TP * DP * p for d in range(DP)] for p in range(PP) for t in range(TP)]
    pp = [[r + TP * DP * p for p in range(PP)] for r in range(TP * DP)]
    mp = [[t + TP * d0 + TP * DP * p for p in range(PP) for t in range(TP)] for d0 in range(DP)]
    return [*tp, *dp, *pp, *mp, *dp, *tp, list(range(WORLD))]


SCRIPT = textwrap.dedent("""
    import json
    import sys

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from nccl_ext.frontend import install

    rank, subgroups, path, layout = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])


    class Transport:
        timeout_s = 30.0

        def __init__(self):
            self.observed = []

        def observe_group(self, ranks, desc):  # as nccl_ext.capture.discover records them
            self.observed.append([list(map(int, ranks)), desc])

        def register_group(self, group):
            pass

        def close(self):
            pass


    transport = Transport()
    install.install(rank=rank, world_size=16, make_transport=lambda *_: transport, timeout_s=30.0,
                    subgroups=subgroups)
    if path == "torch":  # torch's own new_group, without the non-member shortcut
        dist.new_group = getattr(dist.new_group, "__wrapped__", dist.new_group)
    dist.init_process_group("gloo")
    calls = [dict(ranks=r, group_desc=f"g{i}") for i, r in enumerate(layout)]
    calls += [dict(ranks=[3, 1]), dict(ranks=(9, 8), backend="gloo"), dict(ranks=None),
              dict(ranks=[rank, (rank + 1) % 16], use_local_synchronization=True),
              dict(ranks=[(rank + 1) % 16, (rank + 2) % 16], use_local_synchronization=True),
              dict(ranks=[(rank + 1) % 16, (rank + 1) % 16]), dict(ranks=[(rank + 1) % 16, 16]),
              dict(ranks=[(rank + 1) % 16, -1]), dict(ranks=[(rank + 1) % 16], backend="no-such-backend"),
              dict(ranks=[(rank + 1) % 16], timeout=5), dict(ranks=iter([(rank + 3) % 16, (rank + 1) % 16])),
              dict(ranks=iter([(rank + 3) % 16, rank])), dict(ranks=7), dict(ranks=[3, 1])]
    out = []
    for kw in calls:
        try:
            pg = dist.new_group(**kw)
        except Exception as e:  # noqa: BLE001 - the error is part of what is compared
            out.append(["error", type(e).__name__, str(e)])
            continue
        if pg is None:
            out.append(["None"])
        elif pg is c10d.GroupMember.NON_GROUP_MEMBER:
            out.append(["NON_GROUP_MEMBER"])
        else:
            out.append([pg.info.key, pg.group_name, sorted(c10d._world.pg_group_ranks[pg].items()),
                        c10d._world.pg_names[pg]])
    world = install.current_world()
    print(json.dumps({"calls": out, "group_count": c10d._world.group_count, "created": world.registry.created,
                      "materialised": world.registry.materialised, "observed": transport.observed}))
""")


def _run(rank: int, subgroups: str, path: str) -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(rank), subgroups, path, json.dumps(_layout())], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def _reference_key(ranks: list[int], occurrence: int) -> str:
    digest = hashlib.blake2b(repr(tuple(ranks)).encode(), digest_size=8).hexdigest()
    return f"{len(ranks)}:{digest}:{occurrence}"


def _reference_keys(rank: int) -> list[str]:
    """Keys of ``rank``'s member groups of the layout, in call order, by the reference definition
    (the default group, made by ``init_process_group``, is the world's first occurrence)."""
    seen: dict[tuple[int, ...], int] = {tuple(range(WORLD)): 1}
    keys = []
    for ranks in _layout():
        ranks = sorted(ranks)
        if rank in ranks:
            occurrence = seen.get(tuple(ranks), 0)
            seen[tuple(ranks)] = occurrence + 1
            keys.append(_reference_key(ranks, occurrence))
    return keys


@pytest.mark.parametrize("rank", [0, 5])
def test_member_keys_are_the_reference_keys_and_both_paths_agree(rank):
    fast = _run(rank, "auto", "fast")
    keys = [c[0] for c in fast["calls"][: len(_layout())] if len(c) == 4]
    assert keys == _reference_keys(rank)
    assert fast == _run(rank, "auto", "torch")
    n = len(_layout())
    assert [c[0] for c in fast["calls"][:n]].count("NON_GROUP_MEMBER") == n - len(keys)
    assert fast["observed"][: n + 1] == [[list(range(WORLD)), "default_pg"],
                                         *([sorted(r), f"g{i}"] for i, r in enumerate(_layout()))]
    assert len(fast["observed"]) == fast["created"]


def test_the_intercepted_helper_gives_the_reference_keys():
    if not install._delegates_new_group():
        pytest.skip("this torch has no delegation: 'auto' already is the intercepted path")
    out = _run(5, "intercept", "fast")
    keys = [c[0] for c in out["calls"][: len(_layout())] if len(c) == 4]
    assert keys == _reference_keys(5)
    assert out["observed"][1 : len(_layout()) + 1] == [[sorted(r), f"g{i}"] for i, r in enumerate(_layout())]
