"""Tests for integrations.cpu_compat / integrations.megatron_compat / integrations.import_hooks."""

import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from integrations import cpu_compat  # noqa: E402
from integrations.import_hooks import after_import  # noqa: E402

RUNNER = os.path.join(ROOT, "tests", "integrations", "compat_runner.py")
RECIPE = os.path.join(ROOT, "examples", "megatron_gpt.py")
STEP_RE = re.compile(r"^step (\d+) \| loss (\S+) \| grad_norm (\S+) \| step_time_ms (\S+)$")


@pytest.fixture
def compat():
    cpu_compat.install()
    try:
        yield cpu_compat
    finally:
        cpu_compat.uninstall()


def _reference_training_step():
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 8, generator=gen)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


# --------------------------------------------------------------------------- unit tests


def test_cuda_device_arguments_become_cpu(compat):
    cases = [
        torch.zeros(2, device="cuda"),
        torch.ones(2, device="cuda:1"),
        torch.empty(2, device=torch.device("cuda", 0)),
        torch.full((2,), 3.0, device=torch.cuda.current_device()),
        torch.tensor([1, 2], device="cuda"),
        torch.arange(3, device="cuda"),
        torch.zeros(2).new_zeros(3, device="cuda"),
        torch.zeros_like(torch.zeros(2), device="cuda"),
        torch.empty(4, pin_memory=True),
    ]
    x = torch.zeros(2)
    cases += [
        x.to("cuda"),
        x.to(0),
        x.to(torch.device("cuda:0"), torch.float64),
        x.to(device="cuda", dtype=torch.float16),
    ]
    for t in cases:
        assert t.device.type == "cpu"
    assert x.to("cuda", torch.float64).dtype == torch.float64
    assert not x.is_cuda  # the device is reported truthfully


def test_cuda_and_pin_memory_are_noops(compat):
    x = torch.randn(3)
    assert x.cuda() is x
    assert x.cuda(0, non_blocking=True) is x
    assert x.pin_memory() is x
    x.record_stream(torch.cuda.current_stream())
    model = torch.nn.Linear(2, 2).cuda()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_type_reports_cuda_names(compat):
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1, dtype=torch.long).type() == "torch.cuda.LongTensor"
    assert torch.nn.Parameter(torch.zeros(1)).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1).type("torch.cuda.HalfTensor").dtype == torch.float16
    assert torch.zeros(1).type(torch.cuda.LongTensor).dtype == torch.int64
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64
    legacy = torch.cuda.IntTensor([1, 2])
    assert legacy.dtype == torch.int32 and legacy.device.type == "cpu"
    assert isinstance(torch.zeros(1), torch.cuda.FloatTensor)
    assert not isinstance(torch.zeros(1), torch.cuda.HalfTensor)


def test_rng_state_roundtrip_uses_cpu_generator(compat):
    state = torch.cuda.get_rng_state()
    a = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), a)

    torch.cuda.manual_seed(123)
    b = torch.randn(4)
    torch.manual_seed(123)
    assert torch.equal(torch.randn(4), b)

    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    assert gen is torch.default_generator
    gen.set_state(state)
    assert torch.equal(torch.rand(4), a)
    assert torch.cuda.initial_seed() == torch.initial_seed()


class _CudaInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        extra = torch.ones(grad.shape, device="cuda")
        return grad * 2 + extra.to(torch.cuda.current_device()) - 1


def test_custom_function_backward_allocating_cuda(compat):
    x = torch.ones(3, requires_grad=True)
    _CudaInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))

    x.grad = None
    torch.autograd.backward(_CudaInBackward.apply(x).sum())
    assert torch.equal(x.grad, torch.full((3,), 2.0))

    (g,) = torch.autograd.grad(_CudaInBackward.apply(x).sum(), x)
    assert torch.equal(g, torch.full((3,), 2.0))

    seen = []
    y = torch.ones(2, requires_grad=True)
    y.register_hook(lambda grad: seen.append(torch.zeros(1, device="cuda").device) or grad)
    _CudaInBackward.apply(y).sum().backward()
    assert seen == [torch.device("cpu")]


def test_torch_cuda_stubs(compat):
    assert torch.cuda.is_available() is False
    assert torch.cuda.current_device() == 0
    assert torch.cuda.device_count() >= 1
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == 0
    assert torch.cuda.max_memory_allocated() == 0
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == 0
    free, total = torch.cuda.mem_get_info()
    assert 0 <= free <= total
    props = torch.cuda.get_device_properties(0)
    assert props.major >= 8 and props.total_memory >= 0
    assert torch.cuda.get_device_capability() == (props.major, props.minor)
    assert torch.cuda.is_current_stream_capturing() is False
    with torch.cuda.device(0):
        pass
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    torch.cuda.nvtx.range_push("x")
    torch.cuda.nvtx.range_pop()
    with torch.cuda.nvtx.range("x"):
        pass


@pytest.mark.parametrize("gpus", [0, 2])
def test_is_available_counts_real_gpus_under_the_nvml_check(monkeypatch, gpus):
    """A CUDA build of torch with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (importing DeepSpeed sets
    it) answers ``is_available`` from ``torch.cuda.device_count``: the stand-in's
    ``LOCAL_WORLD_SIZE`` must not make a machine without a GPU report CUDA."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)  # a CUDA build, whatever is installed
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)  # the GPUs this machine has
    stock = torch.cuda.is_available
    cpu_compat.install()
    try:
        assert torch.cuda.device_count() == 4
        assert torch.cuda.is_available() is (gpus > 0)
    finally:
        cpu_compat.uninstall()
    assert torch.cuda.is_available is stock


def test_plain_cpu_code_unchanged(compat):
    cpu_compat.uninstall()
    ref_loss, ref_grads = _reference_training_step()
    cpu_compat.install()
    loss, grads = _reference_training_step()
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_install_idempotent_and_uninstall_restores():
    original = torch.cuda.current_device
    depth = torch._C._len_torch_function_stack()
    cpu_compat.install()
    cpu_compat.install()
    assert cpu_compat.is_installed()
    assert torch._C._len_torch_function_stack() == depth + 1
    cpu_compat.uninstall()
    assert not cpu_compat.is_installed()
    assert torch.cuda.current_device is original
    assert torch._C._len_torch_function_stack() == depth
    assert torch.zeros(1).type() == "torch.FloatTensor"


_LATE_INSTALL_CHECK = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {root!r})
    import torch
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from integrations import cpu_compat, megatron_compat
    cpu_compat.install()
    megatron_compat.install()

    # Names bound by 'from torch.cuda import ...' before install were rebound.
    assert mrandom._lazy_call is torch.cuda._lazy_call
    assert mrandom.device_ctx_manager is torch.cuda.device

    # The RNG tracker forks the generator CPU kernels actually use.
    torch.manual_seed(1)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.add("tp", 77)
    before = torch.get_rng_state()
    with tracker.fork("tp"):
        forked = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(77)
    assert torch.equal(torch.rand(4), forked)

    # Megatron fixes.
    assert moe_utils.te_general_gemm is None
    assert isinstance(moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True),
                      __import__("numpy").ndarray)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                            tensor_model_parallel_size=2, sequence_parallel=True)
    norm = WrappedTorchNorm(cfg, 8)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    print("LATE_INSTALL_OK")
    """
)


def test_late_install_after_megatron_import():
    pytest.importorskip("megatron.core")
    out = subprocess.run(
        [sys.executable, "-c", _LATE_INSTALL_CHECK.format(root=ROOT)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "LATE_INSTALL_OK" in out.stdout, out.stdout + out.stderr


# --------------------------------------------------------------------------- import hooks


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """A module name nothing has imported yet, importable from ``tmp_path``."""
    name = f"prism_hook_probe_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_after_import_patches_once_right_after_the_import(fresh_module):
    import importlib

    calls = []

    def first(module):
        calls.append(("first", module.VALUE))
        module.VALUE = 2

    def second(module):
        calls.append(("second", module.VALUE))

    after_import(fresh_module, first)
    after_import(fresh_module, second)
    after_import(fresh_module, first)  # registered twice: runs once
    assert calls == []
    module = importlib.import_module(fresh_module)
    assert calls == [("first", 1), ("second", 2)] and module.VALUE == 2
    importlib.import_module(fresh_module)
    after_import(fresh_module, first)
    assert len(calls) == 2
    # the wrapping loader is gone once the module has run
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__.loader is module.__loader__
    from integrations import import_hooks

    assert import_hooks._FINDER.find_spec("json.tool", None) is None, "other modules are left alone"


def test_after_import_on_an_imported_module_runs_now_once_across_threads(fresh_module):
    import importlib

    module = importlib.import_module(fresh_module)
    calls = []
    barrier = threading.Barrier(8)

    def patch(mod):
        calls.append(mod)

    def register():
        barrier.wait()
        after_import(fresh_module, patch)

    threads = [threading.Thread(target=register) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [module]


# --------------------------------------------------------------------------- recipe under torchrun


def _run_recipe(*runner_args, nproc=4, iters=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        RUNNER,
        *runner_args,
        RECIPE,
        "--tensor-model-parallel-size=2",
        "--pipeline-model-parallel-size=2",
        f"--train-iters={iters}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    steps = [m.groups() for m in map(STEP_RE.match, out.stdout.splitlines()) if m]
    return [(int(s), loss, norm) for s, loss, norm, _ in steps]


def test_recipe_tp2_pp2_torchrun_deterministic():
    pytest.importorskip("megatron.core")
    first = _run_recipe()
    # Second run installs the layer after megatron.core was imported (as a
    # launcher forking ranks from a parent that imported it does).
    second = _run_recipe("--late-install")
    # TP2*PP2 on 4 ranks -> DP1: exactly one logging rank (last stage, TP rank 0).
    assert [s for s, _, _ in first] == [1, 2]
    for _, loss, norm in first:
        assert math.isfinite(float(loss)) and math.isfinite(float(norm))
    assert first == second
