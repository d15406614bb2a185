"""Routers' auxiliary losses: encoded exactly into a dispatch all-to-all's integers beside gate
counts, read when that all-to-all is issued, found in the events and summed up per name, step
and layer; megatron-core's own tracker hands them over (both its APIs)."""

import json
import math
import types

import pytest
import torch

from integrations import megatron_probe, moe_aux
from integrations.deepspeed_gate_counts import TAG as GATE_TAG
from integrations.deepspeed_gate_counts import encode as gate_encode
from integrations.deepspeed_moe import gate_of
from nccl_ext.core import routing_counts
from nccl_ext.core.ops import Collective


@pytest.fixture(autouse=True)
def _nothing_attached():
    routing_counts.take_attached()
    yield
    routing_counts.take_attached()


@pytest.mark.parametrize("value", [1.0625, 0.1 + 0.2, 3.5e-7, -2.0, float("inf")])
def test_a_value_round_trips_bit_for_bit(value):
    got = moe_aux.decode(moe_aux.encode(7, "seq_load_balancing_loss", value))
    assert got == {"layer": 7, "name": "seq_load_balancing_loss", "value": value}


def test_other_integers_are_no_aux_loss():
    assert moe_aux.decode([GATE_TAG, 0, 2, 4, 1, 1, 1, 1]) is None
    v = moe_aux.encode(1, "z_loss", 0.5)
    assert moe_aux.decode(v[:-1]) is None and moe_aux.decode([moe_aux.TAG, 1, 99, 1]) is None


def test_the_value_is_read_when_the_all_to_all_is_issued_beside_gate_counts():
    loss = torch.tensor(2.0)
    moe_aux.attach(3, "l_aux", loss)
    routing_counts.attach(gate_encode(3, 8, [5, 3], [5, 3]))
    loss.mul_(1.5)  # read late: the value the tensor holds when the dispatch is issued
    counts = torch.tensor([4, 4], dtype=torch.int64)
    assert routing_counts.small_ints(Collective.ALL_GATHER, [counts]) == [[4, 4]]  # not consumed by counts
    ints = routing_counts.small_ints(Collective.ALL_TO_ALL, [torch.zeros(2, 3)])
    assert moe_aux.decode(ints[0]) == {"layer": 3, "name": "l_aux", "value": 3.0}
    row = {"kind": "collective", "extra": json.dumps({"kind": "all_to_all", "ints": ints})}
    assert gate_of(row)["exp_counts"] == [5, 3]  # the gate's counts found beside the loss
    assert routing_counts.take_attached() is None


def test_a_later_value_of_the_same_layer_and_name_replaces_the_earlier():
    moe_aux.attach(1, "z_loss", 1.0)
    moe_aux.attach(1, "z_loss", 2.0)
    moe_aux.attach(2, "z_loss", 4.0)
    got = [moe_aux.decode(v) for v in routing_counts.take_attached()]
    assert [(g["layer"], g["value"]) for g in got] == [(1, 2.0), (2, 4.0)]


def _row(rank, unit, values_list):
    return {"rank": rank, "unit": unit, "kind": "collective",
            "extra": json.dumps({"kind": "all_to_all", "ints": values_list})}


def test_collect_by_name_step_and_layer():
    rows = [_row(r, u, [moe_aux.encode(layer, "load_balancing_loss", 1.0 + r + u + layer / 10)])
            for r in (0, 1) for u in (0, 1) for layer in (1, 2)]
    rows.append(_row(0, 0, [moe_aux.encode(1, "z_loss", 0.25), [1, 2, 3]]))
    rows.append({"rank": 0, "unit": 0, "kind": "p2p", "extra": None})
    got = moe_aux.collect(rows)
    lb = got["load_balancing_loss"]
    assert lb["calls"] == 8 and lb["ranks"] == 2
    assert lb["mean"] == pytest.approx(1 + 0.5 + 0.5 + 0.15)
    assert [s["step"] for s in lb["per_step"]] == [0, 1]
    assert lb["per_step"][1]["mean"] - lb["per_step"][0]["mean"] == pytest.approx(1.0)
    assert [x["layer"] for x in lb["per_layer"]] == [1, 2]
    assert got["z_loss"]["mean"] == 0.25 and got["z_loss"]["calls"] == 1
    assert moe_aux.collect([_row(0, 0, [[1, 2]])]) == {}


def test_nan_values_are_left_out_of_means():
    rows = [_row(0, 0, [moe_aux.encode(1, "l_aux", float("nan"))]), _row(0, 0, [moe_aux.encode(2, "l_aux", 2.0)])]
    assert moe_aux.collect(rows)["l_aux"]["mean"] == 2.0
    only_nan = moe_aux.collect([_row(0, 0, [moe_aux.encode(1, "l_aux", float("nan"))])])
    assert only_nan["l_aux"]["mean"] is None and math.isnan(moe_aux.decode(moe_aux.encode(1, "x", float("nan")))["value"])


def test_megatron_cores_trackers_hand_their_values_over(monkeypatch):
    """Both of megatron-core's APIs (0.16: ``save_to_aux_losses_tracker`` bound in ``router``;
    0.19: ``MoEMetricsTracker.record``) on stand-in modules with their signatures; the
    original still runs."""
    seen = []
    router = types.ModuleType("megatron.core.transformer.moe.router")

    def save_to_aux_losses_tracker(name, loss, layer_number, num_layers, reduce_group=None, avg_group=None):
        seen.append(("save", name, layer_number))

    router.save_to_aux_losses_tracker = save_to_aux_losses_tracker
    logging = types.ModuleType("megatron.core.transformer.moe.moe_logging")

    class MoEMetricsTracker:
        def record(self, name, value, layer_number, num_layers, reduce_group=None, avg_group=None, needs_dp_avg=True):
            seen.append(("record", name, layer_number))

    logging.MoEMetricsTracker = MoEMetricsTracker
    megatron_probe._patch_router(router)
    megatron_probe._patch_logging(logging)
    router.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.5), 3, 8, reduce_group=None)
    MoEMetricsTracker().record("z_loss", torch.tensor(0.25), 4, 8, avg_group=None)
    router.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(9.0), None, 8)  # no layer: not sent
    assert seen == [("save", "load_balancing_loss", 3), ("record", "z_loss", 4), ("save", "load_balancing_loss", None)]
    got = [moe_aux.decode(v) for v in routing_counts.take_attached()]
    assert got == [{"layer": 3, "name": "load_balancing_loss", "value": 1.5}, {"layer": 4, "name": "z_loss", "value": 0.25}]


def test_megatron_core_installed_here_has_one_of_the_two_apis():
    pytest.importorskip("megatron.core")
    import importlib

    router = importlib.import_module("megatron.core.transformer.moe.router")
    try:
        logging = importlib.import_module("megatron.core.transformer.moe.moe_logging")
    except ImportError:
        logging = None
    old = "save_to_aux_losses_tracker" in vars(router)
    new = logging is not None and "record" in vars(getattr(logging, "MoEMetricsTracker", object))
    assert old or new, "megatron-core's routers hand their aux losses to neither known tracker"


def test_the_dispatchers_host_copies_leave_cpu_tensors_to_the_original_and_rebind_the_dispatcher():
    """On CPU the probe's wrapper hands tensors to the function it wraps (megatron-core's, or the
    CPU layer's); the token dispatcher, which bound the name at its import, gets the wrapper."""
    calls = []
    moe_utils = types.ModuleType("megatron.core.transformer.moe.moe_utils")

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        calls.append((as_numpy, record_stream))
        return tensor.numpy() if as_numpy else tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    dispatcher = types.ModuleType("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    import sys

    saved = sys.modules.get(dispatcher.__name__)
    sys.modules[dispatcher.__name__] = dispatcher
    try:
        megatron_probe._pinned_move(moe_utils)
    finally:
        if saved is None:
            del sys.modules[dispatcher.__name__]
        else:
            sys.modules[dispatcher.__name__] = saved
    assert dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu is not maybe_move_tensor_to_cpu
    t = torch.arange(3)
    assert moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True).tolist() == [0, 1, 2] and calls == [(True, False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_values_are_read_through_pinned_memory():
    from nccl_ext.core import host_read

    t = torch.arange(5, device="cuda")
    pinned = host_read.to_pinned(t)
    assert pinned.is_pinned()
    torch.cuda.synchronize()
    assert pinned.tolist() == [0, 1, 2, 3, 4] and host_read.read([t, t * 2]) == [[0, 1, 2, 3, 4], [0, 2, 4, 6, 8]]


def test_host_values_are_read_as_they_are():
    from nccl_ext.core import host_read

    assert host_read.read([torch.tensor([[1, 2], [3, 4]]), torch.tensor(2.5)]) == [[1, 2, 3, 4], [2.5]]


def test_pre_drop_counts_ride_the_dispatch_and_are_found_there():
    routing_map = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    moe_aux.attach_pre_drop(routing_map)
    ints = routing_counts.small_ints(Collective.ALL_TO_ALL, [torch.zeros(3, 2)])
    row = {"kind": "collective", "extra": json.dumps({"kind": "all_to_all", "ints": ints})}
    assert moe_aux.pre_drop_of(row) == [3, 1, 1, 1]
    assert moe_aux.pre_drop_of({"kind": "collective", "extra": json.dumps({"kind": "all_to_all"})}) is None


def test_megatron_cores_token_dropping_hands_its_pre_drop_map_over():
    router = types.ModuleType("megatron.core.transformer.moe.router")

    def apply_router_token_dropping(routing_probs, routing_map, router_topk, capacity_factor, drop_policy="probs",
                                    pad_to_capacity=False):
        return routing_probs, routing_map & torch.tensor([True, True, False, True])

    router.apply_router_token_dropping = apply_router_token_dropping
    megatron_probe._patch_token_dropping(router)
    routing_map = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    _probs, kept = router.apply_router_token_dropping(torch.zeros(2, 4), routing_map, router_topk=2, capacity_factor=1.0)
    assert kept.sum().item() == 2
    [values] = routing_counts.take_attached()
    assert values == [moe_aux.PRE_DROP_TAG, 1, 1, 2, 0]
