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
contribution to the gather is what it dropped. Where that group has one member (no op), the
capture's probe sends the pre-drop counts with the dispatch all-to-all
(:func:`integrations.moe_aux.attach_pre_drop`). A trace without either derives them from the
recipe's flags (sequence length, micro-batch size, top-k, tp with sequence parallelism, cp) when
they are given, else reports them as not derivable.
With ``--moe-pad-expert-input-to-capacity`` the dispatcher exchanges fixed capacities and no
counts: such traces show no dispatches.

The counts are read from the events (``extra["ints"]``, kept by value in every payload mode:
:mod:`nccl_ext.core.routing_counts`), or from stored tensors in older traces. Nothing here
depends on recognising a flag but the dropped-token count without an aux loss. The routers'
auxiliary losses come with the dispatch all-to-alls (:mod:`integrations.megatron_probe`,
:mod:`integrations.moe_aux`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from integrations import moe_aux
from integrations.megatron_flags import get_flag


def _extra(row: dict) -> dict:
    return json.loads(row["extra"]) if row.get("extra") else {}


def _values(row: dict, read_tensor: Callable[[int, str], object]) -> list[int] | None:
    """A count op's values: recorded by value in every payload mode (``extra["ints"]``,
    :mod:`nccl_ext.core.routing_counts`), else from a stored tensor (older traces), else None."""
    ints = _extra(row).get("ints")
    if ints:
        return [int(x) for x in ints[0]]
    if row.get("tensor_key"):
        return [int(x) for x in read_tensor(row["rank"], row["tensor_key"]).tolist()]
    return None


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


class LayerOrder:
    """Which MoE layer of its pipeline stage each token dispatch of one rank is, from the op order
    alone (no flag read): a forward pass runs its layers' dispatches in order, each followed by
    the same few all-to-alls (tokens, maybe probabilities, the combine); a backward pass or a
    pipeline send/receive lies between two forward passes. So a dispatch starts layer 0 again
    after a step marker or a point-to-point op, or when more all-to-alls than the fewest ever
    seen between two dispatches precede it; on a rank without point-to-point ops whose gaps are
    all alike, every dispatch is its forward pass's only MoE layer."""

    def __init__(self, evs: list[dict]) -> None:
        self._gathers: list[tuple[int, int, bool]] = []   # (idx, all-to-alls since the last, boundary since)
        self._has_p2p = any(r["kind"] == "p2p" for r in evs)
        self._layer: dict[int, int] | None = None
        self._evs = evs

    def _scan(self) -> dict[int, int]:
        gaps: list[tuple[int, int, bool]] = []
        a2a, boundary, seen = 0, True, False
        pending = None
        for row in self._evs:
            if row["kind"] in ("p2p", "marker"):
                boundary = True
                continue
            if row["kind"] != "collective":
                continue
            if _is_count_op(row, "all_gather"):
                pending = row
                continue
            if _extra(row).get("kind") == "all_to_all":
                if pending is not None:  # a dispatch: the gather, then its token all-to-all
                    gaps.append((pending["idx"], a2a if seen else -1, boundary or not seen))
                    a2a, boundary, seen, pending = 0, False, True, None
                a2a += 1
        clean = [c for _i, c, b in gaps if not b]
        fewest = min(clean) if clean else 0
        alike = bool(clean) and max(clean) == fewest and not self._has_p2p
        out, layer = {}, 0
        for i, c, b in gaps:
            layer = 0 if (b or c > fewest or alike) else layer + 1
            out[i] = layer
        return out

    def layer_of(self, gather: dict) -> int | None:
        if self._layer is None:
            self._layer = self._scan()
        return self._layer.get(gather["idx"])


def find_dispatches(rows: list[dict], groups: dict[int, tuple[int, ...]],
                    read_tensor: Callable[[int, str], object], script_args: list[str] | None = None,
                    complete: Callable[[list[int], dict[int, list[int]]], dict[int, list[int]] | None] | None = None
                    ) -> dict:
    """Every token dispatch in the trace.

    ``complete(gather members, {captured member: counts})``: every member's counts where some
    members were not captured (an EP-folded capture's derivation), or None to skip the dispatch.

    Returns ``{"dispatches": [...], "notes": [...]}``; a dispatch is ``{"unit", "group",
    "seq", "layer" (of the stage, :class:`LayerOrder`), "num_experts", "counts": {rank: [tokens per
    expert]}, "pre_drop": {rank: [...]} | None,
    "ep_group": {rank: [ranks of its EP group]}, "splits": {rank: [tokens sent per EP rank]}}``.
    """
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], []).append(row)
    found: dict[tuple[int, int], dict] = {}
    for rank, evs in by_rank.items():
        evs.sort(key=lambda r: r["idx"])
        layers = LayerOrder(evs)
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
                                           "ep_group": {}, "splits": {}, "layer": layers.layer_of(gather)})
                d["keys"][rank] = _values(gather, read_tensor)
                d["pre_keys"][rank] = _values(pre_row, read_tensor) if pre_row is not None else moe_aux.pre_drop_of(row)
                d["ep_group"][rank] = list(groups[row["group"]])
                d["splits"][rank] = [s[0] if s else 0 for s in _extra(row).get("shapes", [])]
    dispatches, incomplete = [], 0
    for (gid, _seq), d in sorted(found.items(), key=lambda kv: (kv[1]["unit"], kv[0][1], kv[0][0])):
        members = groups[gid]
        d["derived"] = []
        if any(d["keys"].get(m) is None for m in members):
            full = complete(list(members), {m: c for m, c in d["keys"].items() if c is not None}) \
                if complete is not None else None
            if full is None:
                incomplete += 1  # e.g. a folded trace: some members were not captured
                continue
            d["derived"] = [m for m in members if d["keys"].get(m) is None]
            ep = next(iter(d["ep_group"].values()))
            for m in d["derived"]:
                d["keys"][m] = full[m]
                if m in ep:
                    d["ep_group"][m] = ep
        d["counts"] = {m: d["keys"][m] for m in members if m in d["ep_group"]}
        pre_ok = all(d["pre_keys"].get(m) for m in members)
        d["pre_drop"] = {m: d["pre_keys"][m] for m in members} if pre_ok else None
        del d["keys"], d["pre_keys"]
        dispatches.append(d)
    notes = []
    if incomplete:
        notes.append(f"{incomplete} dispatches skipped: not every member of their gather recorded its counts")
    out = {"dispatches": dispatches, "notes": notes, "dropped_source": None, "aux_losses": moe_aux.collect(rows)}
    if dispatches:
        if all(d["pre_drop"] is not None for d in dispatches):
            out["dropped_source"] = ("the routers' pre-drop token counts (their aux-loss all-reduce, or sent with the "
                                     "dispatch) minus routed tokens")
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
