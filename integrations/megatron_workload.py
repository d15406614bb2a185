"""What one training step of a Megatron-style recipe processes, read from its script
arguments: tokens per step (global batch × sequence length) and Megatron-LM's own count of
model FLOPs (``num_floating_point_operations`` of ``megatron/training/training.py``, dense
and MoE GPT with MHA/GQA; MLA, hybrid and linear-attention models are not covered).

The report's throughput figures use the FLOPs counted in the ranks (torch's
``FlopCounterMode``, :mod:`prism_launch.rank.flops`); this count is the cross-check. The two
differ by design where the program does what the formula leaves out: causal attention is
counted half by Megatron (only the unmasked half of ``QKᵀ`` and ``AV`` does work in a fused
kernel) but whole by FlopCounterMode when the attention is plain batched matmuls (the local
spec); recomputed forwards (``--recompute-*``) are counted by FlopCounterMode alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from integrations.megatron_flags import get_flag

__all__ = ["Shape", "shape", "model_flops", "num_floating_point_operations", "tokens_per_step"]


@dataclass(frozen=True, slots=True)
class Shape:
    """The model and batch flags the formula reads (Megatron-LM's names, defaults where Megatron has them)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int
    num_query_groups: int
    kv_channels: int
    swiglu: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int = 1
    global_batch_size: int | None = None


def _int(args: list[str], flag: str) -> int | None:
    v = get_flag(args, flag)
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{flag} must be an integer (got {v!r})") from None


def shape(args: list[str]) -> Shape | None:
    """The model's shape from its flags; None where a flag the formula needs is absent
    (the recipe's own defaults are not known here)."""
    need = {k: _int(args, f"--{k.replace('_', '-')}") for k in
            ("num_layers", "hidden_size", "num_attention_heads", "seq_length")}
    vocab = _int(args, "--padded-vocab-size") or _int(args, "--vocab-size")
    if any(v is None for v in need.values()) or vocab is None:
        return None
    h, heads = need["hidden_size"], need["num_attention_heads"]
    gqa = bool(get_flag(args, "--group-query-attention"))
    return Shape(
        **need, vocab_size=vocab,
        ffn_hidden_size=_int(args, "--ffn-hidden-size") or 4 * h,
        num_query_groups=(_int(args, "--num-query-groups") or 1) if gqa else heads,
        kv_channels=_int(args, "--kv-channels") or h // heads,
        swiglu=bool(get_flag(args, "--swiglu")),
        num_experts=_int(args, "--num-experts"),
        moe_router_topk=_int(args, "--moe-router-topk") or 2,
        moe_ffn_hidden_size=_int(args, "--moe-ffn-hidden-size"),
        moe_shared_expert_intermediate_size=_int(args, "--moe-shared-expert-intermediate-size"),
        moe_layer_freq=_int(args, "--moe-layer-freq") or 1,
        global_batch_size=_int(args, "--global-batch-size"),
    )


def num_floating_point_operations(s: Shape, batch_size: int) -> float:
    """Megatron-LM's model FLOPs of one step over ``batch_size`` sequences (forward and
    backward: each GEMM three times; causal attention half)."""
    if s.num_experts is None:
        dense, moe, routed = s.num_layers, 0, 0
    else:
        moe = sum(1 for i in range(s.num_layers) if i % s.moe_layer_freq == 0)
        dense, routed = s.num_layers - moe, s.moe_router_topk
    fb, fma = 3, 2
    ffn_x = 3 if s.swiglu else 2
    moe_ffn = s.moe_ffn_hidden_size if s.moe_ffn_hidden_size is not None else s.ffn_hidden_size
    shared = s.moe_shared_expert_intermediate_size or 0
    q = s.kv_channels * s.num_attention_heads
    kv = s.kv_channels * s.num_query_groups
    attn = fb * fma * (s.hidden_size * (q + 2 * kv) + q * s.seq_length / 2 * 2 + q * s.hidden_size)
    mlp = fb * fma * s.hidden_size * (s.ffn_hidden_size * ffn_x * dense + moe_ffn * routed * ffn_x * moe
                                      + shared * ffn_x * moe)
    logits = fb * fma * s.hidden_size * s.vocab_size
    return batch_size * s.seq_length * (mlp + attn * s.num_layers + logits)


def _data_parallel(args: list[str], world_size: int) -> int | None:
    tp = _int(args, "--tensor-model-parallel-size") or 1
    pp = _int(args, "--pipeline-model-parallel-size") or 1
    cp = _int(args, "--context-parallel-size") or 1
    if world_size % (tp * pp * cp):
        return None
    return world_size // (tp * pp * cp)


def tokens_per_step(args: list[str], world_size: int, embedded_tokens: int | None) -> tuple[int | None, str]:
    """Tokens the whole job trains on per step, and how that was found: ``--global-batch-size``
    × ``--seq-length`` where the recipe passes both; else the tokens one first-stage rank
    embedded in the counted step (``embedded_tokens``, its replica's share; a context-parallel
    rank's share of each sequence) × data-parallel × context-parallel size; else unknown."""
    gbs, seq = _int(args, "--global-batch-size"), _int(args, "--seq-length")
    if gbs and seq:
        return gbs * seq, "--global-batch-size × --seq-length (script args)"
    dp = _data_parallel(args, world_size)
    if embedded_tokens and dp:
        cp = _int(args, "--context-parallel-size") or 1
        return embedded_tokens * dp * cp, ("tokens embedded by a first-stage rank in the counted step × "
                                           f"data-parallel size {dp}" + (f" × context-parallel size {cp}" if cp > 1 else ""))
    return None, "tokens unknown (no --global-batch-size/--seq-length, no embedding counted)"


def model_flops(args: list[str], world_size: int) -> tuple[float | None, str]:
    """Megatron-LM's own count of one step's model FLOPs (:func:`num_floating_point_operations`
    over ``--global-batch-size`` sequences), for programs whose FLOPs the capture could not count
    (torch.compile'd ones); None, with why, where the flags do not give the model's shape."""
    try:
        s = shape(args)
    except ValueError as e:
        return None, f"Megatron-LM's formula: {e}"
    if s is None or not s.global_batch_size:
        return None, ("Megatron-LM's formula needs --num-layers, --hidden-size, --num-attention-heads, "
                      "--seq-length, a vocabulary size and --global-batch-size among the script's flags")
    return num_floating_point_operations(s, s.global_batch_size), \
        f"Megatron-LM's formula (num_floating_point_operations) over --global-batch-size {s.global_batch_size}"
