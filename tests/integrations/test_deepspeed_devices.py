"""DeepSpeed on CUDA under prism-launch, exercised without a GPU: logical CUDA indices onto the
rank's physical GPU (``prism_launch/launch/devices.py`` with a stand-in ``torch.cuda``, the
TorchFunctionMode with a stand-in target device, DeepSpeed's CUDA accelerator from the rank
plan), ZeRO-3's rank-0 consistency broadcasts when rank 0 is not captured (a broadcast whose
root is absent hands back the stand-in's own buffer), the refused op builds, and DeepSpeed's
compatibility layer joining on CUDA."""

from types import SimpleNamespace

import pytest
import torch

from prism_launch.launch import devices

# ----------------------------------------------------------------------- the device mapping


def test_map_index_and_map_device():
    cuda0 = torch.device("cuda", 0)
    assert devices.map_index(5, 0) == 0 and devices.map_index("cuda:7", 0) == "cuda:0"
    assert devices.map_index(torch.device("cuda", 3), 1) == torch.device("cuda", 1)
    for same in ("cuda", "cpu", None, True, torch.device("cpu"), torch.device("cuda")):
        assert devices.map_index(same, 0) is same
        assert devices.map_device(same, cuda0) is same
    assert devices.map_device("cuda:5", cuda0) == cuda0 and devices.map_device(5, cuda0) == cuda0
    assert devices.map_device(torch.device("cuda", 7), cuda0) == cuda0
    assert devices.map_device("cuda:0", cuda0) == "cuda:0"


class _FakeCuda:
    """``torch.cuda`` as far as :func:`devices.install` touches it, on a machine with ``n`` GPUs."""

    def __init__(self, n: int):
        self.n, self.calls = n, []
        fake = self

        class device:
            def __init__(self, device):
                self.idx = -1 if device is None else int(str(device).rsplit(":", 1)[-1])
                fake.calls.append(("device", self.idx))

        self.device = device
        for name in devices.DEVICE_FUNCTIONS:
            setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        def fn(device=None):
            self.calls.append((name, device))
        fn.__name__ = name
        return fn

    def is_available(self):
        return True

    def device_count(self):
        return self.n

    def set_device(self, device):
        self.calls.append(("set_device", device))


@pytest.fixture
def fresh_devices():
    saved = dict(devices._STATE)
    devices._STATE.clear()
    yield
    mode = devices._STATE.pop("mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)
    devices._STATE.clear()
    devices._STATE.update(saved)


@pytest.mark.parametrize("slot, gpus, physical", [(0, 1, 0), (5, 1, 0), (5, 2, 1), (9, 8, 1)])
def test_every_cuda_index_lands_on_the_slots_gpu(fresh_devices, slot, gpus, physical):
    cuda = _FakeCuda(gpus)
    assert devices.install(slot, cuda=cuda, local_rank=physical, mode=False) == physical
    assert devices.physical() == physical
    assert cuda.calls == [("set_device", physical)]
    cuda.calls.clear()
    cuda.set_device(7)  # get_accelerator().set_device(local_rank) ends here
    cuda.synchronize(7)
    cuda.memory_allocated(device="cuda:6")
    cuda.get_device_properties(torch.device("cuda", 5))
    cuda.max_memory_allocated()  # None: the current device
    cuda.device(6)
    assert cuda.calls == [("set_device", physical), ("synchronize", physical), ("memory_allocated", f"cuda:{physical}"),
                          ("get_device_properties", torch.device("cuda", physical)), ("max_memory_allocated", None),
                          ("device", physical)]


def test_the_mode_is_pushed_only_for_a_logical_gpu_that_is_not_here(fresh_devices):
    devices.install(0, cuda=_FakeCuda(1), local_rank=0)
    assert "mode" not in devices._STATE  # LOCAL_RANK 0 is GPU 0: nothing to map in torch calls
    devices._STATE.clear()
    devices.install(3, cuda=_FakeCuda(1), local_rank=3)
    assert isinstance(devices._STATE["mode"], devices.LogicalCudaMode)
    assert devices._STATE["mode"].target == torch.device("cuda", 0)


def test_torch_calls_naming_a_logical_gpu_land_on_the_target():
    """The mode's rewriting, with ``meta`` standing in for the physical GPU (no CUDA here)."""
    meta = torch.device("meta")
    with devices.LogicalCudaMode(meta):
        assert torch.empty(2, device="cuda:5").device == meta
        assert torch.zeros(2, device=torch.device("cuda", 7)).device == meta
        assert torch.tensor([1, 2], device=torch.device("cuda", 3)).device == meta
        assert torch.ones(2).to("cuda:3").device == meta
        assert torch.ones(2).to(torch.device("cuda", 6), torch.float64).dtype == torch.float64
        assert torch.ones(2).to(torch.float16).device.type == "cpu"  # a dtype is not a device
        local_rank = 5
        lin = torch.nn.Linear(2, 2).to(f"cuda:{local_rank}")  # DeepSpeed's engine: module.to(self.device)
        assert lin.weight.device == meta
        assert torch.ones(2, device="cpu").device.type == "cpu"


# ---------------------------------------------------------------- DeepSpeed's accelerator

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

from integrations import deepspeed_compat as dsc  # noqa: E402


@pytest.fixture
def accelerator(monkeypatch):
    from deepspeed.accelerator import cuda_accelerator

    dsc._patch_accelerator(cuda_accelerator)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    saved = dsc.physical_gpu()
    yield cuda_accelerator.CUDA_Accelerator(), calls
    dsc.set_physical_gpu(saved)


def test_deepspeeds_cuda_accelerator_reports_the_mapped_gpu(accelerator):
    acc, calls = accelerator
    dsc.set_physical_gpu(0)
    assert acc.device_name("5") == "cuda:0"  # ZeRO-3: device_name(os.environ["LOCAL_RANK"])
    assert acc.device_name(7) == "cuda:0"  # the engine: torch.device(device_name(local_rank))
    assert acc.device_name() == "cuda"
    assert acc.device(5) == torch.device("cuda", 0)  # init_process_group's device_id
    acc.set_device(5)
    assert calls == [0]


def test_without_a_mapping_the_accelerator_is_deepspeeds(accelerator):
    acc, calls = accelerator
    dsc.set_physical_gpu(None)  # mode=real, CPU
    assert acc.device_name(5) == "cuda:5" and acc.device(5) == torch.device("cuda", 5)
    acc.set_device(5)
    assert calls == [5]


@pytest.mark.parametrize("mode, gpus, rank, physical", [("capture", 1, 1001, 0), ("emulate", 2, 1001, 1),
                                                         ("capture", 8, 1000, 0), ("real", 1, 1001, None)])
def test_the_integration_takes_the_launchers_rule_from_the_plan(monkeypatch, mode, gpus, rank, physical):
    from prism_launch.config.plan import RankPlan

    plan = RankPlan(mode=mode, device="cuda", timeout_s=5.0, local_ranks=(1000, 1001))
    for k, v in {**plan.to_env(), "RANK": str(rank)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert dsc._plan_physical_gpu() == physical
    assert physical is None or physical == plan.device_slot(rank) % gpus  # devices.install's slot


# ------------------------------------------------------ ZeRO-3's consistency checks, rank 0 absent


class _StandInBroadcast:
    """``deepspeed.comm`` for rank 1000 of a folded capture without rank 0: a broadcast from
    root 0 leaves the caller's buffer as it is (the stand-in's own buffer is the result)."""

    def __init__(self):
        self.calls = 0

    def get_rank(self):
        return 1000

    def broadcast(self, tensor, src, async_op=False):
        assert src == 0
        self.calls += 1


def _zero_utils(dist):
    from deepspeed.runtime.zero import utils

    acc = SimpleNamespace(device_name=lambda i=None: "cpu")
    return SimpleNamespace(torch=torch, dist=dist, get_accelerator=lambda: acc,
                           get_lst_from_rank0=utils.get_lst_from_rank0.__dict__.get("__wrapped__",
                                                                                     utils.get_lst_from_rank0),
                           assert_lst_len_same_as_other_ranks=utils.assert_lst_len_same_as_other_ranks.__dict__.get(
                               "__wrapped__", utils.assert_lst_len_same_as_other_ranks))


def test_deepspeeds_own_check_fails_without_rank_0(monkeypatch):
    """What the capture hit ('disagreement on list length between rank0 and rank1000')."""
    from deepspeed.runtime.zero import utils

    monkeypatch.setenv("LOCAL_RANK", "0")
    mod = _zero_utils(_StandInBroadcast())
    monkeypatch.setattr(utils, "dist", mod.dist)
    monkeypatch.setattr(utils, "get_accelerator", mod.get_accelerator)
    with pytest.raises(RuntimeError, match="rank0: -1"):
        mod.assert_lst_len_same_as_other_ranks([1, 2, 3])


def test_consistency_checks_pass_when_the_stand_in_serves_rank_0(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    dist = _StandInBroadcast()
    mod = _zero_utils(dist)
    dsc._patch_zero_utils(mod)
    mod.assert_lst_len_same_as_other_ranks([4, 5, 6])
    assert mod.get_lst_from_rank0([4, 5, 6]) == [4, 5, 6]
    assert dist.calls == 2
    assert mod.get_lst_from_rank0([]) == [] and dist.calls == 2  # nothing to broadcast


def test_the_real_module_is_patched_on_import():
    dsc.install()
    from deepspeed.runtime.zero import utils

    assert utils.assert_lst_len_same_as_other_ranks.__prism_patched__
    assert utils.get_lst_from_rank0.__prism_patched__


# ------------------------------------------------------------------------------ op builds


@pytest.mark.parametrize("builder, hint", [("CPUAdamBuilder", "zero_force_ds_cpu_optimizer"),
                                           ("FusedAdamBuilder", "torch_adam")])
def test_an_op_that_is_not_built_is_refused_with_the_fix(builder, hint):
    dsc.install()
    from deepspeed.ops.op_builder import builder as ob
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder  # noqa: F401

    assert ob.OpBuilder.jit_load.__prism_patched__
    op = {"CPUAdamBuilder": CPUAdamBuilder, "FusedAdamBuilder": FusedAdamBuilder}[builder]()
    with pytest.raises(dsc.DeepSpeedOpNotBuilt, match=hint) as e:
        op.load()
    assert repr(op.name) in str(e.value) and "DS_BUILD_" in str(e.value)


# ------------------------------------------------------------------ compat joins on CUDA


def test_deepspeeds_compat_layer_is_activated_on_cuda():
    from prism_launch.modes.context import compat_modules

    names = ["cpu", "megatron", "deepspeed"]
    cuda = compat_modules(SimpleNamespace(on_cuda=True, compat=SimpleNamespace(integrations=names)))
    cpu = compat_modules(SimpleNamespace(on_cuda=False, compat=SimpleNamespace(integrations=names)))
    assert cuda == ("integrations.deepspeed_compat",)
    assert cpu == ("integrations.cpu_compat", "integrations.megatron_compat", "integrations.deepspeed_compat")


def test_only_integrations_that_name_explicit_indices_pay_for_the_mode():
    import importlib

    assert importlib.import_module("integrations.deepspeed_compat").EXPLICIT_CUDA_INDICES is True
    for name in ("integrations.megatron_compat", "integrations.cpu_compat"):
        assert not getattr(importlib.import_module(name), "EXPLICIT_CUDA_INDICES", False), name
