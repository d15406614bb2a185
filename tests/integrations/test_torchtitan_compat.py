"""torchtitan's compatibility layer on a CPU-only torch: ``import torchtitan`` works without
Triton (its kernels module sees a stand-in only while it runs, torch never does), MoE token
permutation takes torchtitan's CPU path, a Triton kernel launch says why it cannot run, and
``nccl`` backends become ``gloo``. The launcher finds ``-m torchtitan.train``'s file without
running ``torchtitan/__init__.py``."""

import subprocess
import sys
import textwrap

import pytest

from integrations.torchtitan_compat import gloo_for_nccl
from prism_launch.trace.fingerprint import module_origin
from tests.conftest import ROOT


@pytest.mark.parametrize(("asked", "given"), [
    ("nccl", "gloo"), ("cuda:nccl,cpu:gloo", "gloo"), ("cpu:gloo,cuda:nccl", "gloo"), ("gloo", "gloo"), (None, None),
])
def test_nccl_becomes_gloo(asked, given):
    assert gloo_for_nccl(asked) == given


def test_module_origin_does_not_run_parent_packages(tmp_path, monkeypatch):
    pkg = tmp_path / "heavy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the parent package ran')\n")
    (pkg / "train.py").write_text("print('train')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_origin("heavy_pkg.train") == str(pkg / "train.py")
    assert "heavy_pkg" not in sys.modules
    assert module_origin("heavy_pkg.missing") is None


def test_torchtitan_imports_without_triton():
    pytest.importorskip("tokenizers", reason="torchtitan's dependencies are not installed")
    from importlib.util import find_spec

    if find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed (pip install 'prism-launch[torchtitan]')")
    if find_spec("triton") is not None:
        pytest.skip("Triton is installed: the stand-in is not used")
    code = textwrap.dedent("""
        import sys, torch
        from integrations import torchtitan_compat as tc
        tc.install()
        import torchtitan.train
        from torchtitan.models.moe import utils, kernels
        assert "triton" not in sys.modules and "triton.language" not in sys.modules
        counts = torch.tensor([1, 2, 0, 3], dtype=torch.int32)
        idx, sizes, offsets = utils.generate_permute_indices(counts, 2, 2, 32, 4)
        ref = kernels.generate_permute_indices.__wrapped__(counts, 2, 2, 32, 4, use_cpu=True)
        assert torch.equal(idx, ref[0]) and torch.equal(sizes, ref[1])
        try:
            kernels.generate_permute_indices.__wrapped__(counts, 2, 2, 32, 4, use_cpu=False)
        except tc.TritonUnavailable as e:
            print("refused:", e)
        import torch.distributed.tensor._random as r
        print("ok", r.is_rng_supported_mesh.__name__)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: torchtitan launched its Triton kernel" in r.stdout and "ok" in r.stdout


def test_pipeline_metadata_inference_runs_on_zeros():
    """torch's pipelining builds a later stage's inference inputs with torch.empty_strided; under
    the layer they are zeros (the bytes its tensor-parallel collectives carry are reproducible)."""
    pipelining = pytest.importorskip("torch.distributed.pipelining._utils")
    if not hasattr(getattr(pipelining, "_TensorMeta", None), "to_tensor"):
        pytest.skip("this torch's pipelining infers stage metadata without TensorMeta.to_tensor")
    code = textwrap.dedent("""
        import torch
        from integrations import torchtitan_compat as tc
        tc.install()
        from torch.distributed.pipelining import _utils
        meta = _utils.extract_tensor_meta(torch.ones(256, 256))
        for _ in range(4):
            del_me = torch.full((256, 256), float("nan"))  # garbage in the allocator's free blocks
            del del_me
            t = meta.to_tensor("cpu")
            assert bool((t == 0).all()), t
        assert getattr(_utils._make_tensor_from_meta, "__prism_patched__", False)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok" in r.stdout


_CP_RANK = """
import sys, torch, torch.distributed as dist, torch.nn.functional as F
from integrations import torchtitan_compat as tc
tc.install()
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._attention import (
    _context_parallel_shard, _ContextParallel, _enable_context_parallel_dispatcher, _HeadTailLoadBalancer)
from torch.distributed.tensor.parallel import parallelize_module

class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
q, k, v, g = (torch.randn(2, 4, 16, 8) for _ in range(4))
full = [t.clone().requires_grad_() for t in (q, k, v)]
ref = F.scaled_dot_product_attention(*full, is_causal=True)
(ref * g).sum().backward()
_enable_context_parallel_dispatcher()
handler = DTensor._op_dispatcher._custom_op_handlers[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
assert handler.__module__ == "integrations.torchtitan_cp", handler
from integrations import torchtitan_cp
from torch.distributed.tensor.experimental._context_parallel import _attention
handlers = dict(DTensor._op_dispatcher._custom_op_handlers)
torchtitan_cp.install(_attention)  # idempotent
assert DTensor._op_dispatcher._custom_op_handlers == handlers
attention = Attention()
parallelize_module(attention, mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
balancer = _HeadTailLoadBalancer(16, 2, "cpu")
shard = lambda ts: _context_parallel_shard(mesh, ts, (2,) * len(ts), load_balancer=balancer)
local = [t.clone().requires_grad_() for t in shard([q, k, v])]
out = attention(*local)
(out * shard([g])[0]).sum().backward()
for name, got, want in zip(("out", "dq", "dk", "dv"), [out.detach(), *[t.grad for t in local]],
                           shard([ref.detach(), *[t.grad for t in full]])):
    assert type(got) is torch.Tensor and got.shape == (2, 4, 8, 8), (name, type(got), got.shape)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (name, (got - want).abs().max())
print("ok", rank, flush=True)
dist.destroy_process_group()
# Leave like the launcher's ranks do (os._exit, no interpreter teardown): the mesh keeps the gloo
# group alive, and a gloo worker that drops a functional collective's work during finalization
# takes the GIL and aborts ("terminate called without an active exception", pytorch#190489).
import os
os._exit(0)
"""


def test_context_parallel_sdpa_on_cpu(tmp_path):
    """torch's ring attention over 2 gloo ranks with CPU tensors (torchtitan's CP: _ContextParallel on
    the attention module, head-tail load balancing, causal): SDPA's CPU flash op and its backward go
    to the ring, and the local output and q/k/v gradients equal full-sequence SDPA's, sharded alike."""
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: SDPA takes the CUDA flash ops, which torch's CP handles itself")
    script = tmp_path / "cp_rank.py"
    script.write_text(_CP_RANK)
    store = tmp_path / "store"
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(store)], cwd=ROOT, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    results = [p.communicate(timeout=120) for p in ranks]
    for r, (p, (out, err)) in enumerate(zip(ranks, results)):
        assert p.returncode == 0, err[-3000:]
        assert f"ok {r}" in out
