"""The capture rank's FLOP counter: one step (the second) counted, under the CPU
compatibility layer's TorchFunctionMode, with the tokens its embedding looked up."""

import torch

from integrations.cpu_compat_mode import CudaAsCpuMode
from prism_launch.rank.flops import COUNTED_STEP, StepFlops, device_info


class Tiny(torch.nn.Module):
    def __init__(self, vocab=50, seq=6, hidden=8):
        super().__init__()
        self.words = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(seq, hidden)
        self.lin = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, ids):
        x = self.words(ids) + self.pos(torch.arange(ids.shape[1]).expand_as(ids))
        return self.lin(x).sum()


def _train(steps: int, counter: StepFlops, batch=3, seq=6, hidden=8):
    torch.manual_seed(0)
    model = Tiny(seq=seq, hidden=hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CudaAsCpuMode():
        for _ in range(steps):
            ids = torch.randint(0, 50, (batch, seq), device="cuda")  # the CPU layer maps it
            model(ids).backward()
            opt.step()
            opt.zero_grad()
            counter.on_step()


def test_counts_the_second_step_alone_under_the_cpu_layer():
    counter = StepFlops()
    _train(4, counter)
    r = counter.summary()
    assert r["step"] == COUNTED_STEP == 2 and r["complete"]
    # Linear 8x8 on 18 tokens: forward 2*18*8*8, backward twice that (input and weight grads)
    assert r["flops"] == 3 * 2 * 18 * 8 * 8
    assert r["embedded_tokens"] == 18  # word and position tables each saw 3x6 ids; not 36
    assert r["counted_by"].endswith("FlopCounterMode")


def test_a_run_of_one_step_counts_nothing_and_an_unfinished_step_says_so():
    one = StepFlops()
    _train(1, one)
    assert one.summary() is not None and one.summary()["complete"] is False
    none = StepFlops()
    assert none.summary() is None


def test_cpu_device_info():
    info = device_info("cpu")
    assert info["kind"] == "cpu" and info["name"] and info["cores"] >= 1


def _silu_mlp_grads(counting: bool) -> tuple[torch.Tensor, int | None]:
    """A bfloat16 SiLU MLP's weight gradient, computed under the step counter or not."""
    torch.manual_seed(1)
    w1 = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(32, 64, dtype=torch.bfloat16)
    x = torch.randn(48, 32, dtype=torch.bfloat16)
    counter = StepFlops()
    if counting:
        counter.on_step()  # step 1 ended: step 2 is counted
    (torch.nn.functional.silu(x @ w1.t()) @ w2.t()).float().square().sum().backward()
    if counting:
        counter.on_step()
    r = counter.summary()
    return w1.grad, (r or {}).get("flops")


def test_the_counted_step_computes_bit_for_bit_as_any_other():
    # FlopCounterMode decomposes ops outside its registry (silu_backward into bfloat16
    # elementwise ops, rounded differently from the fused kernel): the counted step's
    # gradients would differ from an uncounted run's in the last bits
    plain, _ = _silu_mlp_grads(counting=False)
    counted, flops = _silu_mlp_grads(counting=True)
    assert torch.equal(counted, plain), int((counted != plain).sum())
    # forward: two matmuls (2*48*32*64 FLOPs each); backward: the hidden gradient and w1's
    # (neither x nor w2 needs a gradient)
    assert flops == 2 * 48 * 32 * 64 * (2 + 2)


def test_without_the_fix_flop_counter_mode_changes_silu_backward():
    """The hazard the counter avoids, kept visible: if torch stops decomposing, this fails and
    the guard in prism_launch/rank/flops.py can go."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(2)
    g, x = torch.randn(64, 768, dtype=torch.bfloat16), torch.randn(64, 768, dtype=torch.bfloat16)
    fused = torch.ops.aten.silu_backward(g, x)
    with FlopCounterMode(display=False):
        decomposed = torch.ops.aten.silu_backward(g, x)
    assert not torch.equal(fused, decomposed)


def test_a_torch_compiled_program_is_not_counted_and_runs_compiled():
    """A program whose step 1 ran torch.compile'd code is left without a dispatch mode (one would
    stop fullgraph frames and cannot see compiled kernels); the summary says why."""
    import subprocess
    import sys
    import textwrap

    from tests.conftest import ROOT

    code = textwrap.dedent("""
        import torch
        from prism_launch.rank.flops import StepFlops, compiled_frames
        assert compiled_frames() == 0
        f = torch.compile(lambda x: (x @ x).relu(), backend="eager", fullgraph=True)
        x = torch.randn(8, 8)
        counter = StepFlops()
        f(x); counter.on_step()          # step 1: compiles
        assert compiled_frames() >= 1
        y = f(x); counter.on_step()      # step 2 runs compiled, no counter in the way
        s = counter.summary()
        assert s["flops"] is None and "torch.compile" in s["skipped"], s
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok" in r.stdout
