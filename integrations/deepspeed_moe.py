"""DeepSpeed's MoE token dispatch (``deepspeed.moe.layer.MoE``), recognised in a PrismTrace
(no DeepSpeed import).

``MOELayer.forward`` runs the gate, then all-to-alls ``[experts, capacity, hidden]`` over the
EP group (``_AllToAll``): EP rank ``j`` of that group receives the capacity slots of experts
``j*L .. (j+1)*L-1`` (``L`` experts per rank). The slots are fixed — the op's size is the
capacity, not the routing — so the counts come from the gate: the capture's forward hook
(:mod:`integrations.deepspeed_gate_counts`) sends each captured rank's tokens per expert with
that dispatch all-to-all (``extra["ints"]``, every payload mode). One dispatch = one MoE layer's
forward on one micro-batch; per rank it gives:

- ``counts``: the routes kept within capacity, per expert (what the experts process);
- ``pre_drop``: the gate's ``exp_counts`` (top-k before the capacity limit): their difference is
  what ``drop_tokens`` dropped (none with ``drop_tokens=False``, whose capacity is the EP
  group's maximum);
- ``layer``: the order in which the rank's gates first ran (the stage's MoE layer).

A dispatch is verified when no expert got more than the capacity and none more than the gate
routed to it. Of an EP-folded capture, uncaptured members' counts come from ``complete`` (the
captured routers' apportioned, as for megatron-core: :mod:`prism_launch.capture.ep_fold`); where
a captured gate dropped tokens at that dispatch, an uncaptured member keeps at most the capacity
of what it routes to an expert (its derived ``exp_counts``), as its gate would have.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from integrations import moe_aux
from integrations.deepspeed_gate_counts import decode


def _extra(row: dict) -> dict:
    return json.loads(row["extra"]) if row.get("extra") else {}


def gate_of(row: dict) -> dict | None:
    """The gate counts a dispatch all-to-all carries (:func:`integrations.deepspeed_gate_counts.decode`), or None."""
    if row["kind"] != "collective" or not row.get("extra") or '"all_to_all"' not in row["extra"]:
        return None
    extra = _extra(row)
    ints = extra.get("ints")
    if extra.get("kind") != "all_to_all" or not ints:
        return None
    for values in ints:  # the gate's counts, beside any other attachment (its auxiliary loss)
        gate = decode([int(v) for v in values])
        if gate is not None:
            return gate
    return None


def find_dispatches(rows: list[dict], groups: dict[int, tuple[int, ...]],
                    read_tensor: Callable[[int, str], object] | None = None, script_args: list[str] | None = None,
                    complete: Callable[[list[int], dict[int, list[int]]], dict[int, list[int]] | None] | None = None
                    ) -> dict:
    """Every token dispatch in the trace, in :func:`integrations.megatron_moe.find_dispatches`'s
    form (``splits`` empty: the all-to-all's pieces are fixed capacities; ``verified`` per
    dispatch, see the module doc). ``read_tensor`` and ``script_args`` are not needed: the counts
    are always in the events."""
    found: dict[tuple[int, int], dict] = {}
    for row in rows:
        gate = gate_of(row)
        if gate is None:
            continue
        d = found.setdefault((row["group"], row["seq"]), {
            "unit": row["unit"], "group": row["group"], "seq": row["seq"], "layer": gate["layer"],
            "num_experts": gate["num_experts"], "capacity": gate["capacity"], "routed": {}, "pre": {},
            "ep_group": {}, "splits": {}})
        if gate["num_experts"] != d["num_experts"]:
            raise ValueError(f"dispatch all-to-all seq {row['seq']} on group {row['group']}: rank {row['rank']}'s gate "
                             f"has {gate['num_experts']} experts, another member's {d['num_experts']}; the trace "
                             "mixes gates of different layers at one op: capture it again")
        d["routed"][row["rank"]] = gate["routed"]
        d["pre"][row["rank"]] = gate["exp_counts"]
        d["capacity"] = max(d["capacity"], gate["capacity"])
        d["ep_group"][row["rank"]] = list(groups[row["group"]])
    dispatches, incomplete = [], 0
    for (gid, _seq), d in sorted(found.items(), key=lambda kv: (kv[1]["unit"], kv[0][1], kv[0][0])):
        members = list(groups[gid])
        d["derived"] = [m for m in members if m not in d["routed"]]
        if d["derived"]:
            routed = complete(members, d["routed"]) if complete is not None else None
            pre = complete(members, d["pre"]) if complete is not None else None
            if routed is None or pre is None:
                incomplete += 1  # e.g. a folded trace without EP folding: some members were not captured
                continue
            if any(d["routed"][m] != d["pre"][m] for m in d["routed"]):  # the capacity binds (drop_tokens)
                routed = {m: c if m in d["routed"] else [min(n, d["capacity"]) for n in pre[m]] for m, c in routed.items()}
            d["routed"], d["pre"] = routed, pre
            for m in d["derived"]:
                d["ep_group"][m] = members
        d["counts"] = {m: d["routed"][m] for m in members}
        d["pre_drop"] = {m: d["pre"][m] for m in members}
        cap = d["capacity"]
        d["verified"] = all(n <= cap and n <= p for m in members if m not in d["derived"]
                            for n, p in zip(d["counts"][m], d["pre_drop"][m]))
        del d["routed"], d["pre"]
        dispatches.append(d)
    notes = []
    if incomplete:
        notes.append(f"{incomplete} dispatches skipped: not every member of their all-to-all sent its gate's counts")
    if dispatches:
        caps = sorted({d["capacity"] for d in dispatches})
        notes.append(f"DeepSpeed all-to-alls move a fixed capacity per expert ({caps[0]}"
                     f"{'' if len(caps) == 1 else f'..{caps[-1]}'} tokens): token counts are the gates'")
    return {"dispatches": dispatches, "notes": notes, "aux_losses": moe_aux.collect(rows),
            "counts_source": "every captured rank's gate counts (exp_counts and the routes kept within capacity), "
                             "sent with its dispatch all-to-all (extra.ints) in every payload mode",
            "dropped_source": ("the gate's exp_counts (top-k before the capacity limit) minus the routes kept within "
                               "capacity" if dispatches else None)}
