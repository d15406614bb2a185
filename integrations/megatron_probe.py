"""What a capture needs of megatron-core beyond its ops (rank side; the registry's ``probe``
role, installed in capturing ranks on every device): its MoE routers' auxiliary losses and
tokens per expert before capacity dropping (``apply_router_token_dropping``'s input), which no
op carries, and its MoE token dispatchers' host copies kept off waits on the GPU.

Host copies: the alltoall dispatcher moves its split sizes and token counts to the host with
``moe_utils.maybe_move_tensor_to_cpu`` (``non_blocking`` on a side stream, then an event
synchronisation at its sync point), into pageable memory, which makes each copy synchronous and
holds the CUDA driver's lock until the stream reaches it. Behind a wait on the GPU
(``capture.gpu_waits``) that stops the rank (:mod:`nccl_ext.core.host_read`). On CUDA the probe
makes those copies into pinned memory, which is what the dispatcher's own event synchronisation
was written for; the values are read after that synchronisation, as before.

megatron-core hands each router's loss values, divided by their coefficient, to its logging
tracker: ``save_to_aux_losses_tracker(name, loss, layer_number, num_layers, ...)`` of
``moe_utils`` (0.16, bound in ``router``) or ``MoEMetricsTracker.record(name, value,
layer_number, num_layers, ...)`` of ``moe_logging`` (0.19). Both are wrapped: the value also
goes to :func:`integrations.moe_aux.attach` (read at the rank's next all-to-all, the token
dispatch; nothing else changes) under its name (``load_balancing_loss``,
``seq_load_balancing_loss``, ``global_load_balancing_loss``, ``z_loss``) and 1-based layer
number. The report's ``moe`` section sums them up (:mod:`integrations.megatron_moe`).
"""

from __future__ import annotations

import sys

from integrations import moe_aux
from integrations.import_hooks import after_import, replaces



def _patch_router(router) -> None:
    if "save_to_aux_losses_tracker" not in vars(router):
        return

    @replaces(router, "save_to_aux_losses_tracker")
    def save_to_aux_losses_tracker(original, name, loss, layer_number, *args, **kwargs):
        if layer_number is not None:
            moe_aux.attach(layer_number, name, loss)
        return original(name, loss, layer_number, *args, **kwargs)


def _patch_token_dropping(router) -> None:
    if "apply_router_token_dropping" not in vars(router):
        return

    @replaces(router, "apply_router_token_dropping")
    def apply_router_token_dropping(original, routing_probs, routing_map, *args, **kwargs):
        moe_aux.attach_pre_drop(routing_map)
        return original(routing_probs, routing_map, *args, **kwargs)


def _patch_logging(moe_logging) -> None:
    cls = getattr(moe_logging, "MoEMetricsTracker", None)
    if cls is None or "record" not in vars(cls):
        return

    @replaces(cls, "record")
    def record(original, self, name, value, layer_number, *args, **kwargs):
        if layer_number is not None:
            moe_aux.attach(layer_number, name, value)
        return original(self, name, value, layer_number, *args, **kwargs)


def _pinned_move(moe_utils) -> None:
    original = getattr(moe_utils, "maybe_move_tensor_to_cpu", None)
    if original is None:
        return

    @replaces(moe_utils, "maybe_move_tensor_to_cpu")
    def maybe_move_tensor_to_cpu(original, tensor, as_numpy=False, record_stream=False):
        import torch

        if not (torch.is_tensor(tensor) and tensor.is_cuda):
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        from nccl_ext.core.host_read import to_pinned

        host = to_pinned(tensor)
        if record_stream:
            tensor.record_stream(torch.cuda.current_stream())
        return host.numpy() if as_numpy else host

    dispatcher = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
    if dispatcher is not None and getattr(dispatcher, "maybe_move_tensor_to_cpu", None) is original:
        dispatcher.maybe_move_tensor_to_cpu = moe_utils.maybe_move_tensor_to_cpu  # bound at its import


def install() -> None:
    """Wrap the trackers and copies now (modules already imported) or as they are imported; a
    patch registered again does nothing (:func:`integrations.import_hooks.after_import`)."""
    after_import("megatron.core.transformer.moe.router", _patch_router)
    after_import("megatron.core.transformer.moe.router", _patch_token_dropping)
    after_import("megatron.core.transformer.moe.moe_logging", _patch_logging)
    after_import("megatron.core.transformer.moe.moe_utils", _pinned_move)
