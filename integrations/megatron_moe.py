"""Megatron-core's MoE token dispatch, recognised in a PrismTrace (no Megatron import).

megatron-core 0.16's ``MoEAlltoAllTokenDispatcher.preprocess`` all-gathers every rank's
``num_local_tokens_per_expert`` (int64, shape ``[num_experts]``) over the expert
tensor x expert parallel group (``gather_from_sequence_parallel_region``), then
``token_dispatch`` calls ``all_to_all_single`` over the EP group with input splits
``num_local_tokens_per_expert.reshape(ep, num_local_experts).sum(1)``. So, per dispatch (one
MoE layer, one micro-batch): each member's contribution to that gather is the number of tokens
it routes to every expert (after capacity dropping), and EP rank ``j`` of the following
all-to-all's group owns experts ``j*L .. (j+1)*L-1`` with ``L = num_experts / ep``.

Dropped tokens (``--moe-expert-capacity-factor``): when an aux loss is on, the router first
all-reduces ``routing_map_for_aux_loss.sum(0)`` — the same top-k before dropping — over the
tensor x context parallel group (int64 ``[num_experts]``); a rank's contribution there minus its
contribution to the gather is what it dropped. Without an aux loss the trace holds no
pre-drop count: it is derived from the recipe's flags (sequence length, micro-batch size,
top-k, tp with sequence parallelism, cp) when they are given, else reported as not derivable.
With ``--moe-pad-expert-input-to-capacity`` the dispatcher exchanges fixed capacities and no
counts: such traces show no dispatches.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from integrations.megatron_flags import get_flag


def _extra(row: dict) -> dict:
    return json.loads(row["extra"]) if row.get("extra") else {}


def _is_count_op(row: dict, kind: str) -> bool:
    return (row["kind"] == "collective" and row["dtype"] == "int64" and len(row["shape"] or []) == 1
            and row["shape"][0] >= 2 and _extra(row).get("kind") == kind)


def _tokens_from_args(script_args: list[str]) -> tuple[int | None, str]:
    """Tokens routed per rank per dispatch (before dropping) from Megatron flags, or None and why."""
    def num(flag, cast=int):
        v = get_flag(script_args, flag)
        return None if v is None or v is True else cast(v)

    seq, mbs = num("--seq-length"), num("--micro-batch-size")
    topk = num("--moe-router-topk")
    if None in (seq, mbs, topk):
        missing = [f for f, v in (("--seq-length", seq), ("--micro-batch-size", mbs), ("--moe-router-topk", topk))
                   if v is None]
        return None, f"the script args do not give {', '.join(missing)}"
    tp, cp = num("--tensor-model-parallel-size") or 1, num("--context-parallel-size") or 1
    sp = get_flag(script_args, "--sequence-parallel") is True
    return seq // cp // (tp if sp else 1) * mbs * topk, "from the recipe's flags"


def find_dispatches(rows: list[dict], groups: dict[int, tuple[int, ...]],
                    read_tensor: Callable[[int, str], object], script_args: list[str] | None = None) -> dict:
    """Every token dispatch in the trace.

    Returns ``{"dispatches": [...], "notes": [...]}``; a dispatch is ``{"unit", "group",
    "seq", "num_experts", "counts": {rank: [tokens per expert]}, "pre_drop": {rank: [...]} | None,
    "ep_group": {rank: [ranks of its EP group]}, "splits": {rank: [tokens sent per EP rank]}}``.
    """
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], []).append(row)
    found: dict[tuple[int, int], dict] = {}
    for rank, evs in by_rank.items():
        evs.sort(key=lambda r: r["idx"])
        pre = None
        pending = None
        for row in evs:
            if row["kind"] != "collective":
                continue
            if _is_count_op(row, "all_reduce"):
                if pre is None:
                    pre = row
                continue
            if _is_count_op(row, "all_gather"):
                pending = (row, pre if pre is not None and pre["shape"] == row["shape"] else None)
                pre = None
                continue
            if pending is not None and _extra(row).get("kind") == "all_to_all":
                gather, pre_row = pending
                pending = None
                key = (gather["group"], gather["seq"])
                d = found.setdefault(key, {"unit": gather["unit"], "group": gather["group"], "seq": gather["seq"],
                                           "num_experts": gather["shape"][0], "keys": {}, "pre_keys": {},
                                           "ep_group": {}, "splits": {}})
                d["keys"][rank] = gather["tensor_key"]
                d["pre_keys"][rank] = pre_row["tensor_key"] if pre_row is not None else None
                d["ep_group"][rank] = list(groups[row["group"]])
                d["splits"][rank] = [s[0] if s else 0 for s in _extra(row).get("shapes", [])]
    dispatches, incomplete = [], 0
    for (gid, _seq), d in sorted(found.items(), key=lambda kv: (kv[1]["unit"], kv[0][1], kv[0][0])):
        members = groups[gid]
        if any(d["keys"].get(m) is None for m in members):
            incomplete += 1  # e.g. a folded trace: some members were not captured
            continue
        d["counts"] = {m: [int(x) for x in read_tensor(m, d["keys"][m]).tolist()] for m in members}
        pre_ok = all(d["pre_keys"].get(m) for m in members)
        d["pre_drop"] = ({m: [int(x) for x in read_tensor(m, d["pre_keys"][m]).tolist()] for m in members}
                         if pre_ok else None)
        del d["keys"], d["pre_keys"]
        dispatches.append(d)
    notes = []
    if incomplete:
        notes.append(f"{incomplete} dispatches skipped: not every member of their gather is in the trace")
    out = {"dispatches": dispatches, "notes": notes, "dropped_source": None}
    if dispatches:
        if all(d["pre_drop"] is not None for d in dispatches):
            out["dropped_source"] = "the router's pre-drop token counts (aux-loss all-reduce) minus routed tokens"
        else:
            args = list(script_args or [])
            if get_flag(args, "--moe-expert-capacity-factor") in (None, True):
                out["dropped_source"] = "dropless: no --moe-expert-capacity-factor in the script args"
                out["tokens_per_dispatch"] = None
                for d in dispatches:
                    d["pre_drop_total"] = {m: sum(c) for m, c in d["counts"].items()}
            else:
                per, why = _tokens_from_args(args)
                if per is None:
                    notes.append(f"dropped tokens not derivable: no aux-loss all-reduce in the trace and {why}")
                else:
                    out["dropped_source"] = f"{per} routed tokens per rank per dispatch {why}, minus routed tokens"
                    for d in dispatches:
                        d["pre_drop_total"] = {m: per for m in d["counts"]}
    return out
