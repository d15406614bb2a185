"""Tests for prism_launch.rank.memory: exact allocator-level accounting of tensor memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from prism_launch.rank import cpu_hook, memory
from prism_launch.rank.memory import MemorySample, MemoryTracker, configure_cpu_hook, cpu_hook_status, set_memory_limit

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
WORKER = HERE / "memory_worker.py"

F32 = 4


class _DeviceToCpuMode(TorchFunctionMode):
    """A process-wide style TorchFunctionMode (like the CPU compatibility layer): device="cuda" -> CPU without CUDA."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda") and not torch.cuda.is_available():
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def function_mode():
    """Every test of this module runs with a TorchFunctionMode on the stack."""
    mode = _DeviceToCpuMode()
    with mode:
        yield mode
    assert mode.calls > 0


@pytest.fixture
def tracker():
    status = cpu_hook_status()
    if not status["active"]:
        pytest.skip(f"CPU allocator hook unavailable: {status['error']}")
    t = MemoryTracker("cpu")
    t.start()
    try:
        yield t
    finally:
        t.stop()
        set_memory_limit("cpu", 0)


class Probe:
    """Current bytes and unit peak relative to the tracker's state at creation."""

    def __init__(self, t: MemoryTracker):
        self.t = t
        t.mark_unit(-1)
        self.base = t.current_bytes()

    def __call__(self) -> tuple[int, int]:
        s = self.t.mark_unit(0)
        return s.current_bytes - self.base, s.peak_bytes - self.base


def test_hook_is_active_here():
    status = cpu_hook_status()
    assert status["active"], status["error"]
    assert status["default_allocator_redirected"]


def test_exact_bytes_views_inplace_and_frees(tracker, function_mode):
    p = Probe(tracker)
    where = "cpu" if torch.cuda.is_available() else "cuda"  # without CUDA the function mode redirects it
    a = torch.empty(1024, device=where)
    assert a.device.type == "cpu"
    assert p() == (1024 * F32, 1024 * F32)
    b = torch.ones(1024)
    assert p() == (2048 * F32, 2048 * F32)

    views = [a.view(32, 32), a[10:20], a.view(32, 32).t(), a.expand(3, 1024), a.unsqueeze(0), a.as_strided((4,), (2,))]
    assert p() == (2048 * F32, 2048 * F32), "views share the storage and count once"

    a.add_(b)
    a.zero_()
    a.fill_(1.5)
    torch.relu_(a)
    a.copy_(b)
    views[0].mul_(views[0])
    assert p() == (2048 * F32, 2048 * F32), "in-place ops allocate nothing"

    c = a + b
    assert p() == (3072 * F32, 3072 * F32)
    del c
    assert p() == (2048 * F32, 3072 * F32)  # a unit's peak starts from the bytes alive when it begins

    del a
    assert p() == (2048 * F32, 2048 * F32), "views keep the storage alive"
    views.clear()
    assert p() == (1024 * F32, 2048 * F32)
    del b
    assert p() == (0, 1024 * F32)
    assert function_mode.calls > 0


def test_peak_within_unit_and_since_start(tracker):
    p = Probe(tracker)
    big = torch.empty(1 << 20, dtype=torch.uint8)
    small = torch.empty(1000, dtype=torch.uint8)
    del big
    cur, peak = p()
    assert (cur, peak) == (1000, (1 << 20) + 1000)
    assert p() == (1000, 1000), "mark_unit resets the per-unit peak to the current bytes"
    assert tracker.peak_bytes() - p.base >= (1 << 20) + 1000
    del small

    s0 = tracker.mark_unit(5)
    x = torch.empty(2048, dtype=torch.uint8)
    del x
    s1 = tracker.mark_unit(6)
    assert isinstance(s1, MemorySample)
    assert (s1.unit, s1.current_bytes, s1.peak_bytes) == (6, s0.current_bytes, s0.current_bytes + 2048)
    assert [s.unit for s in tracker.samples][-2:] == [5, 6]


def test_autograd_saved_tensors_are_freed_after_backward(tracker):
    n = 1000
    p = Probe(tracker)
    x = torch.randn(n, requires_grad=True)
    assert p() == (n * F32, n * F32)
    y = x.exp()  # saves its result for backward
    loss = y.sum()
    del y  # still held by the graph
    assert p() == (2 * n * F32 + F32, 2 * n * F32 + F32)
    loss.backward()
    # during backward: x, saved y, loss, the seed gradient and x's new gradient;
    # after it: the graph (and with it y) is released, x.grad stays.
    assert p() == (2 * n * F32 + F32, 3 * n * F32 + 2 * F32)
    assert x.grad is not None and x.grad.shape == (n,)
    del loss
    assert p() == (2 * n * F32, 2 * n * F32 + F32)
    x.grad = None
    del x
    assert p() == (0, 2 * n * F32)


def test_storage_constructors_and_non_allocator_memory(tracker):
    import numpy as np

    p = Probe(tracker)
    s = torch.UntypedStorage(1000)  # asks c10 for the default CPU allocator directly
    assert p() == (1000, 1000)
    s.resize_(3000)  # a new block of 3000 replaces the old one
    assert p() == (3000, 4000)
    del s
    arr = np.zeros(1000, dtype=np.float32)
    t1 = torch.from_numpy(arr)  # numpy's memory, not the CPU allocator's
    t2 = torch.frombuffer(bytearray(100), dtype=torch.uint8)
    assert p() == (0, 3000)
    assert p() == (0, 0)
    t3 = t1.clone()  # a real allocation
    assert p() == (1000 * F32, 1000 * F32)
    del t1, t2, t3


def test_matches_profiler_allocator_reports_on_a_training_step(tracker):
    """The profiler's own allocator reports (c10::reportMemoryUsageToProfiler) agree to the byte."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 128)

    def step():
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()

    step()  # optimizer state and gradients exist from here on
    p = Probe(tracker)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        cur, peak = p()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    running = replay_peak = 0
    for e in events:
        running += e.nbytes()
        replay_peak = max(replay_peak, running)
    assert len(events) > 20
    assert (cur, peak) == (running, replay_peak)
    assert peak > 0


def test_threads_allocate_and_free_consistently(tracker):
    p = Probe(tracker)
    keep: list[list[torch.Tensor]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        for k in range(300):
            t = torch.empty(100 + i, dtype=torch.uint8)
            if k % 3 == 0:
                keep[i].append(t)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    kept = sum(t.numel() for ts in keep for t in ts)
    assert kept == sum(100 * (100 + i) for i in range(4))
    cur, peak = p()
    assert cur == kept
    assert kept <= peak <= kept + 4 * 2 * 103  # each thread: its kept blocks, the last one and a new one
    # freed on another thread than the one that allocated
    th = threading.Thread(target=keep.clear)
    th.start()
    th.join()
    assert p() == (0, kept)  # the unit started with the kept blocks alive


def test_cpu_memory_limit_raises_out_of_memory(tracker):
    p = Probe(tracker)
    keep = torch.empty(10_000, dtype=torch.uint8)
    set_memory_limit("cpu", tracker.current_bytes() + 64 * 1024)
    ok = torch.empty(60 * 1024, dtype=torch.uint8)
    with pytest.raises(torch.OutOfMemoryError, match="CPU out of memory"):
        torch.empty(8 * 1024, dtype=torch.uint8)
    assert p()[0] == 10_000 + 60 * 1024, "a refused allocation leaves the counters untouched"
    del ok
    a = torch.ones(100, 100)
    with pytest.raises(torch.OutOfMemoryError):
        a @ a.new_ones(100, 200)  # an op's own output allocation: 80000 bytes > what is left
    assert tracker.summary()["limit_bytes"] > 0
    assert tracker.summary()["overhead"]["refused_by_limit"] >= 2
    set_memory_limit("cpu", 0)
    big = torch.empty(1 << 20, dtype=torch.uint8)  # no limit any more
    del big, keep, a


def test_summary_is_json_and_names_the_method(tracker):
    x = torch.empty(10)
    tracker.mark_unit(0)
    del x
    s = tracker.summary()
    json.dumps(s)
    assert s["method"]["name"] == "c10-cpu-allocator-hook"
    assert s["device"] == "cpu"
    assert s["peak_bytes"] >= s["current_bytes"] >= 0
    assert s["samples"][-1]["unit"] == 0
    assert s["overhead"]["allocations"] >= 1
    tracker.stop()
    frozen = tracker.summary()
    y = torch.empty(1000)
    assert tracker.summary()["current_bytes"] == frozen["current_bytes"]
    with pytest.raises(RuntimeError):
        tracker.mark_unit(1)
    del y


def test_start_is_idempotent_and_one_cpu_tracker_at_a_time(tracker):
    tracker.start()
    other = MemoryTracker("cpu")
    with pytest.raises(RuntimeError, match="another CPU MemoryTracker"):
        other.start()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compatibility layer is for CPU-only torch")
def test_late_install_under_cpu_compat_layer_in_subprocess():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, str(WORKER)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMWORKER ")]
    out = json.loads(line[len("MEMWORKER ") :])
    method = out["summary"]["method"]
    if method["name"] == "unavailable":
        pytest.skip(method["detail"])
    assert out["a_device"] == "cpu"
    assert out["after_a"] - out["start_current"] == 1000 * F32
    assert out["after_free_pre"] == out["after_a"], "freeing a block allocated before the hook changes nothing"
    assert method["late_install"] is True
    assert method["untracked_at_start_bytes"] == 123_456
    assert any("CUDA is not available" in n for n in method["notes"])
    # after each step: parameters, gradients and the input
    expected = out["param_bytes"] * 2 + out["x_bytes"]
    assert [u["current"] for u in out["units"]] == [out["start_current"] + expected] * 3
    assert all(u["peak"] > u["current"] for u in out["units"])
    assert out["oom"] and "CPU out of memory" in out["oom"]
    assert out["summary"]["peak_bytes"] == max(u["peak"] for u in out["units"])


def test_without_the_hook_the_summary_says_so():
    code = (
        "import json, torch\n"
        "from prism_launch.rank.memory import MemoryTracker, configure_cpu_hook, set_memory_limit\n"
        "configure_cpu_hook(enabled=False)\n"
        "t = MemoryTracker('cpu'); t.start(); x = torch.empty(100); t.mark_unit(0)\n"
        "try:\n"
        "    set_memory_limit('cpu', 1 << 20); err = None\n"
        "except RuntimeError as e:\n"
        "    err = str(e)\n"
        "print('MEMSUMMARY ' + json.dumps({'summary': t.summary(), 'limit_error': err}))\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMSUMMARY ")]
    out = json.loads(line[len("MEMSUMMARY ") :])
    method = out["summary"]["method"]
    assert method["name"] == "unavailable" and method["complete"] is False
    assert "disabled by memory.cpu_hook=false" in method["detail"]
    assert out["summary"]["peak_bytes"] == 0
    assert "disabled by memory.cpu_hook=false" in out["limit_error"]


def test_configuration_is_fixed_once_the_hook_was_used():
    cpu_hook_status()  # the hook was tried in this process
    configure_cpu_hook()  # the configuration in force: nothing to change
    with pytest.raises(RuntimeError, match="after the CPU allocator hook was first used"):
        configure_cpu_hook(enabled=False)


def test_build_goes_to_the_configured_cache_and_follows_the_source(tmp_path, monkeypatch):
    """The library is cached under the configured root, keyed by the source file's content:
    an edited source builds a new library (built here, not loaded)."""
    if cpu_hook._compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(cpu_hook, "_CACHE_DIR", tmp_path / "cache")
    first = cpu_hook._build()
    assert first.is_file() and first.parent == tmp_path / "cache" / "cpu_alloc_hook"
    assert cpu_hook._build() == first, "an unchanged source reuses the cached library"
    edited = tmp_path / "cpu_alloc_hook.cpp"
    edited.write_text(cpu_hook.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_hook, "SOURCE", edited)
    second = cpu_hook._build()
    assert second.is_file() and second != first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tracker_and_limit():
    t = MemoryTracker("cuda")
    t.start()
    base = t.current_bytes()
    a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty(1 << 21, dtype=torch.uint8, device="cuda")
    del b
    s0 = t.mark_unit(0)
    assert s0.current_bytes - base == 1 << 20
    assert s0.peak_bytes - base == (1 << 20) + (1 << 21)
    s1 = t.mark_unit(1)
    assert s1.peak_bytes == s1.current_bytes
    assert t.peak_bytes() - base == (1 << 20) + (1 << 21)
    assert t.summary()["method"]["name"] == "cuda-caching-allocator"
    total = torch.cuda.get_device_properties(0).total_memory
    set_memory_limit("cuda", 1 << 30)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    finally:
        set_memory_limit("cuda", total)
    t.stop()
    del a


def test_cuda_request_without_cuda_is_measured_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    t = MemoryTracker("cuda")
    assert t.device == "cpu"
    t.start()
    try:
        assert any("CUDA is not available" in n for n in t.method()["notes"])
        assert t.method()["name"] in (memory._HOOK_NAME, "unavailable")
    finally:
        t.stop()


def test_communication_layer_copies_stay_out_of_the_programs_memory(tracker):
    """Checksumming or sending a non-contiguous contribution copies it outside the program's
    allocator (a real backend reads the program's tensor in place): the bytes are right and the
    program's current and peak memory do not move."""
    from nccl_ext.core import wire

    x = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    h = x.to(torch.bfloat16)
    views = [x.t(), x[:, ::2], x[::3], h.t(), h[:, ::2]]
    expected = [bytes(v.contiguous().view(torch.uint8).numpy()) for v in views]
    p = Probe(tracker)
    for v, want in zip(views, expected):
        assert not v.is_contiguous()
        assert bytes(wire.tensor_bytes(v)) == want
        wire.digest(v)
    assert p() == (0, 0)


def test_cuda_summary_after_stop_keeps_the_reserved_peak(monkeypatch):
    """A capture admits ranks to the GPU by their peak *reserved* bytes, read from the summary a
    rank sends when it ends (after stop()). Without it admission fell back to the allocated
    peak: a Llama-3-8B-shaped stage measured ~11 GiB allocated against ~20 GiB reserved, and
    the card ran out of memory. (torch.cuda faked: no GPU here.)"""
    state = {"alloc": 1 << 30, "max_alloc": 11 << 30, "res": 2 << 30, "max_res": 20 << 30}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "memory_allocated", lambda i=None: state["alloc"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda i=None: state["max_alloc"])
    monkeypatch.setattr(cuda, "memory_reserved", lambda i=None: state["res"])
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda i=None: state["max_res"])
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda i=None: None)
    monkeypatch.setattr(memory.MemoryTracker, "_comm", lambda self: 0)
    tracker = MemoryTracker("cuda:0")
    tracker.start()
    tracker.mark_unit(0)
    tracker.stop()
    state.update(max_res=0, res=0)  # what the allocator says after the program freed everything
    out = tracker.summary()
    assert out["peak_reserved_bytes"] == 20 << 30
    assert out["peak_bytes"] == 11 << 30
