"""Context parallelism (torch's ring attention) for SDPA on CPU tensors.

torchtitan applies context parallelism to SDPA with torch's ``_ContextParallel`` and
``_enable_context_parallel_dispatcher()``: q, k and v become DTensors sharded on the sequence
dimension (``Shard(2)``), and DTensor hands the fused attention ops it knows
(``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` and their backwards) to torch's
ring attention (``_templated_ring_attention`` and ``_templated_ring_attention_backward`` in
``torch.distributed.tensor.experimental._context_parallel._attention``). On CPU tensors SDPA
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu`` instead, which CP does not
know: DTensor has no sharding strategy for it and the job stops in its first attention.

:func:`install` (run right after that module is imported, where CUDA is not available) adds
the CPU flash op and its backward to CP's own tables, so they are active exactly while CP's
dispatcher is enabled, like the CUDA ops:

* CP's custom-op handlers (``_attention.custom_ops``) route them to torch's ring attention,
  called with the CPU kernel as the per-block attention op (it returns ``(out, logsumexp)`` with
  the logsumexp laid out ``(batch, heads, seq)`` like the CUDA flash op's, which is what the ring's
  merge expects);
* CP's sharding rules (``_sharding_rules.register_cp_sharding_rules``) gain a ``Shard(2)``
  strategy for both ops, registered and unregistered with CP's own.

No attention math is written here: each block is the CPU flash kernel, the merge and the KV
rotation are torch's. Checked against torch 2.13.
"""

from __future__ import annotations

from types import ModuleType

from integrations.import_hooks import replaces

__all__ = ["install", "CPU_FORWARD", "CPU_BACKWARD"]

CPU_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
CPU_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"
SEQ_DIM = 2
"""The sequence dimension of q, k, v (batch, heads, seq, head_dim) and of the logsumexp
(batch, heads, seq); torch's ring attention hard-codes it too."""


def _ops():
    import torch

    aten = torch.ops.aten
    return getattr(aten, CPU_FORWARD).default, getattr(aten, CPU_BACKWARD).default


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Ring attention over ``mesh``'s group with the CPU flash kernel for each block:
    ``(out, logsumexp)`` of the local query shard against every rank's keys and values."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    if attn_mask is not None:
        raise NotImplementedError(
            "context parallelism on CPU: SDPA with an explicit attn_mask cannot be sharded on the sequence; "
            "use is_causal=True (torchtitan's sdpa attention does) or FlexAttention")
    forward, _ = _ops()
    return _attention._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, forward, query=query, key=key, value=value,
        is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                   attn_mask=None, scale=None):
    """The ring backward of :func:`_ring_forward`: ``(grad_query, grad_key, grad_value)`` for the
    local shards, the key and value gradients sent back round the ring to their owners."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    if attn_mask is not None:
        raise NotImplementedError("context parallelism on CPU: SDPA's backward with an explicit attn_mask "
                                  "cannot be sharded on the sequence")
    _, backward = _ops()
    return _attention._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, backward, grad_out=grad_out, grad_out_name="grad_out",
        query=query, key=key, value=value, out=out, logsumexp=logsumexp,
        is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _cpu_sdpa_handler(op_call, args, kwargs):
    """DTensor custom-op handler for the CPU flash op and its backward, the counterpart of CP's
    ``_sdpa_handler``: propagate the ``Shard(2)`` strategy, run the ring on the local shards,
    wrap the results as DTensors."""
    from torch.distributed.tensor import DTensor

    forward, _ = _ops()
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise RuntimeError(
            f"context parallelism on CPU: {op_call} needs q, k and v sharded on the sequence dimension "
            f"(Shard({SEQ_DIM})) on the CP mesh, got {op_info.schema}; apply torch's _ContextParallel "
            "to the attention module")
    ring = _ring_forward if op_call == forward else _ring_backward
    local = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def _forward_strategy(op_schema):
    """Outputs (out, logsumexp) and inputs (q, k, v) all sharded on the sequence dimension."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    return expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(), op_schema, [[Shard(SEQ_DIM)] * 5], input_index=2)


def _backward_strategy(op_schema):
    """Outputs (grad q, k, v) and inputs (grad_out, q, k, v, out, logsumexp) all sharded on the
    sequence dimension."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    return expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(validate=False), op_schema, [[Shard(SEQ_DIM)] * 9], input_index=3)


def _register_cpu_rules(rules: ModuleType) -> None:
    """Add the CPU ops' strategies to CP's registered rules (so CP's unregister removes them)."""
    forward, backward = _ops()
    for op, strategy in ((forward, _forward_strategy), (backward, _backward_strategy)):
        if op not in rules._cp_strategy_contexts:
            ctx = rules._op_strategy_context(op, strategy)
            ctx.__enter__()
            rules._cp_strategy_contexts[op] = ctx


def _patch_rules(rules: ModuleType) -> None:
    """``register_cp_sharding_rules`` registers the CPU ops' strategies after CP's own."""

    @replaces(rules, "register_cp_sharding_rules")
    def register_cp_sharding_rules(original):
        original()
        _register_cpu_rules(rules)

    if rules._cp_strategy_contexts:  # CP's dispatcher is already on
        _register_cpu_rules(rules)


def _missing(attention: ModuleType, rules: ModuleType) -> list[str]:
    """The torch internals this module relies on that ``attention`` and ``rules`` lack."""
    wanted = {attention: ("custom_ops", "_sdpa_handler", "_templated_ring_attention",
                          "_templated_ring_attention_backward"),
              rules: ("register_cp_sharding_rules", "_cp_strategy_contexts", "_op_strategy_context")}
    return [f"{mod.__name__}.{name}" for mod, names in wanted.items() for name in names if not hasattr(mod, name)]


def install(attention: ModuleType) -> None:
    """Teach CP (``attention``: torch's ``_context_parallel._attention`` module) the CPU flash op
    and its backward. Idempotent; a no-op where CUDA is available (SDPA then takes CUDA's ops).
    On a torch whose CP internals differ it warns and changes nothing (jobs without CP are
    unaffected; a CP job then stops at DTensor's "no sharding strategy" for the CPU op)."""
    import warnings

    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules

    if torch.cuda.is_available():
        return
    missing = _missing(attention, _sharding_rules)
    if missing:
        warnings.warn(f"context parallelism on CPU is not available with torch {torch.__version__}: it lacks "
                      f"{', '.join(missing)} (torch 2.13 has them); update integrations/torchtitan_cp.py for it",
                      RuntimeWarning, stacklevel=2)
        return
    forward, backward = _ops()
    _patch_rules(_sharding_rules)
    if attention.custom_ops.get(forward) is _cpu_sdpa_handler:
        return
    ours = {forward: _cpu_sdpa_handler, backward: _cpu_sdpa_handler}
    attention.custom_ops.update(ours)
    live = DTensor._op_dispatcher._custom_op_handlers
    if live.get(torch.ops.aten._scaled_dot_product_flash_attention.default) is attention._sdpa_handler:
        DTensor._op_dispatcher._custom_op_handlers = {**live, **ours}  # CP's dispatcher is already on
