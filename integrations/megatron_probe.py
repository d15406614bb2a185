"""What a captured megatron-core rank computes that no op of the trace carries: its MoE routers'
auxiliary losses (rank side; installed in capturing ranks on every device).

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

import threading

from integrations import moe_aux
from integrations.import_hooks import after_import, replaces

_LOCK = threading.Lock()
_INSTALLED = False


def _patch_router(router) -> None:
    if "save_to_aux_losses_tracker" not in vars(router):
        return

    @replaces(router, "save_to_aux_losses_tracker")
    def save_to_aux_losses_tracker(original, name, loss, layer_number, *args, **kwargs):
        if layer_number is not None:
            moe_aux.attach(layer_number, name, loss)
        return original(name, loss, layer_number, *args, **kwargs)


def _patch_logging(moe_logging) -> None:
    cls = getattr(moe_logging, "MoEMetricsTracker", None)
    if cls is None or "record" not in vars(cls):
        return

    @replaces(cls, "record")
    def record(original, self, name, value, layer_number, *args, **kwargs):
        if layer_number is not None:
            moe_aux.attach(layer_number, name, value)
        return original(self, name, value, layer_number, *args, **kwargs)


def install() -> None:
    """Wrap the trackers now (modules already imported) or as they are imported."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
        after_import("megatron.core.transformer.moe.router", _patch_router)
        after_import("megatron.core.transformer.moe.moe_logging", _patch_logging)
