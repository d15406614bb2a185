"""The allow-list an unsigned trace's object payloads are unpickled through: plain data, tensors,
numpy and the frameworks' dataclasses pass; any other global is refused by name, before it runs."""

import argparse
import collections
import dataclasses
import datetime
import enum
import io
import os
import pathlib
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from nccl_ext.frontend import safe_unpickle
from nccl_ext.frontend.safe_unpickle import RestrictedPayloadError, loads


class _System:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_calls_os_system_is_refused_by_name(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(_System(marker))
    with pytest.raises(RestrictedPayloadError, match=r"names posix\.system.*trace\.trusted=true"):
        loads(data)
    assert not marker.exists()
    pickle.loads(data)  # the same bytes through plain pickle do run: the test's premise
    assert marker.exists()


@pytest.mark.parametrize("name", ["builtins.eval", "builtins.getattr", "subprocess.Popen", "torch.load",
                                  "torch.storage.UntypedStorage", "collections.Counter"])
def test_other_globals_are_refused(name):
    module, attr = name.rsplit(".", 1)
    data = b"\x80\x04" + b"c" + module.encode() + b"\n" + attr.encode() + b"\n."
    with pytest.raises(RestrictedPayloadError, match=f"names {name},"):
        loads(data)


def test_a_storage_nested_save_is_loaded_weights_only(tmp_path):
    """A tensor's storage pickles as torch.save bytes that torch would load with
    weights_only=False; the restricted path loads them under torch's own allow-list."""
    buf = io.BytesIO()
    torch.save(_System(tmp_path / "ran"), buf, _use_new_zipfile_serialization=False)
    data = b"\x80\x04" + b"ctorch.storage\n_load_from_bytes\n" + pickle.dumps(buf.getvalue(), 4)[2:-1] + b"\x85R."
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        loads(data)
    assert not (tmp_path / "ran").exists()


class Kind(enum.Enum):
    a = 1


class Plain:
    pass


@dataclasses.dataclass
class Plan:
    items: list


def test_plain_data_tensors_and_numpy_pass():
    obj = {
        "args": argparse.Namespace(lr=0.1, name="x"), "od": collections.OrderedDict(a=1), "t": torch.arange(6.)[1:4],
        "p": torch.nn.Parameter(torch.ones(2)), "bf": torch.ones(3, dtype=torch.bfloat16), "dtype": torch.float16,
        "dev": torch.device("cpu"), "size": torch.Size([2, 3]), "np": np.arange(4).reshape(2, 2),
        "np_scalar": np.float32(1.5), "when": datetime.datetime(2024, 1, 2), "set": {1, 2}, "bytes": b"\x00",
        "none": None, "complex": 1j, "tuple": (1, "a", 2.0), "layout": torch.strided,
        "qdtype": torch.qint8, "path": pathlib.PurePosixPath("/a/b"),
    }
    for protocol in (2, 4, 5):
        back = loads(pickle.dumps(obj, protocol))
        assert back.keys() == obj.keys()
        assert torch.equal(back["t"], obj["t"]) and isinstance(back["p"], torch.nn.Parameter)
        assert back["np"].tolist() == obj["np"].tolist() and back["size"] == obj["size"]
        assert back["args"] == obj["args"] and back["dtype"] is torch.float16
    assert loads(pickle.dumps(torch.channels_last, 4)) is torch.channels_last  # as torch._utils.torch.channels_last


def test_dataclasses_and_enums_only_from_allowed_frameworks(monkeypatch):
    data = pickle.dumps([Plan([1]), Kind.a])
    with pytest.raises(RestrictedPayloadError, match=f"names {__name__}.Plan"):
        loads(data)
    monkeypatch.setattr(safe_unpickle, "ALLOWED_PREFIXES", (__name__,))
    assert loads(data) == [Plan([1]), Kind.a]
    monkeypatch.setattr(safe_unpickle, "ALLOWED_PREFIXES", (__name__,))
    with pytest.raises(RestrictedPayloadError, match=f"names {__name__}.Plain,"):
        loads(pickle.dumps(Plain()))  # not a dataclass: its module being allowed is not enough


def test_torch_distributed_checkpoint_save_plans_pass():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    plan = SavePlan([WriteItem(index=MetadataIndex("w", torch.Size([0])), type=WriteItemType.TENSOR)])
    assert loads(pickle.dumps(plan)) == plan


def test_install_routes_torch_object_collectives_through_the_allow_list(tmp_path):
    """torch's own _tensor_to_object (what broadcast_object_list and the other object
    collectives call) unpickles through the restricted class once installed."""
    tensor, size = c10d._object_to_tensor(_System(tmp_path / "ran"), torch.device("cpu"), None)
    try:
        safe_unpickle.install()
        assert safe_unpickle.installed()
        with pytest.raises(RestrictedPayloadError, match="posix.system"):
            c10d._tensor_to_object(tensor, int(size), None)
        assert not (tmp_path / "ran").exists()
        ok, size = c10d._object_to_tensor({"a": torch.ones(2)}, torch.device("cpu"), None)
        assert torch.equal(c10d._tensor_to_object(ok, int(size), None)["a"], torch.ones(2))
    finally:
        safe_unpickle.uninstall()
    assert c10d._unpickler is pickle.Unpickler
