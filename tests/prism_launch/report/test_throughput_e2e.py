"""The bundled Megatron recipe through prism-launch: the report carries tokens/s, model
TFLOP/s per GPU and FLOPs counted in the ranks, which agree with Megatron's own formula."""

import json
from pathlib import Path

import pytest

from integrations.megatron_workload import num_floating_point_operations, shape
from tests.conftest import EXAMPLES, run_prism

RECIPE = EXAMPLES / "megatron_gpt.py"
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "128", "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("mfu")
    args = ["--nnodes", "4", "--nproc-per-node", "4", "device=cpu", "sandbox.ranks=[15]", "comm.timeout_s=120",
            "trace.dir=prism_traces/mfu", "report.dir=report", RECIPE, "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--train-iters", "3", "--global-batch-size", "16", *SHAPE]
    r = run_prism(args, cwd=cwd, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(next(Path(cwd).rglob("report.json")).read_text())
    memory = json.loads(next(Path(cwd).rglob("prism_traces/mfu/memory.json")).read_text())
    return report, memory, r.stderr, args, cwd


def test_the_report_prints_throughput_and_tflops(demo):
    report, _memory, stderr, *_ = demo
    t = report["predicted"]["throughput"]
    assert t["tokens_per_step"] == 16 * 32  # --global-batch-size x --seq-length
    assert t["tokens_per_s"] == pytest.approx(16 * 32 / report["predicted"]["iteration_time_s"])
    assert t["tokens_per_s_per_gpu"] == pytest.approx(t["tokens_per_s"] / 16)
    assert t["model_tflops_per_gpu"] > 0
    assert t["mfu"] is None  # cpu_local: no peak, no band
    assert report["predicted"]["mfu_warning"] is None
    assert "tokens/s/GPU" in stderr and "TFLOP/s per GPU" in stderr
    assert "compute not scaled: measured on a CPU" in stderr


def test_counted_flops_agree_with_megatrons_formula(demo):
    """FlopCounterMode counts the local spec's attention as plain batched matmuls over the whole
    s x s score matrix; Megatron counts the causal half. With that term doubled they agree
    within 1% (the rest: matmuls the formula leaves out, none here)."""
    report, memory, _stderr, args, _cwd = demo
    counted = report["predicted"]["throughput"]["model_flops_per_step"]
    s = shape([str(a) for a in args[args.index(RECIPE) + 1:]])
    formula = num_floating_point_operations(s, batch_size=16)
    q = s.kv_channels * s.num_attention_heads
    causal_half = 16 * s.seq_length * s.num_layers * 3 * 2 * q * s.seq_length  # the half Megatron leaves out
    assert counted == pytest.approx(formula + causal_half, rel=0.01), (counted, formula)
    assert all(m["model_flops"]["step"] == 2 and m["model_flops"]["complete"] for m in memory.values())
    assert all(m["device"]["kind"] == "cpu" for m in memory.values())


def test_cpu_spans_on_a_gpu_cluster_get_an_mfu_and_its_warning(demo):
    """The same trace emulated against h100_ib: MFU against the H100's 989 TFLOP/s, far below
    the plausible band, with the warning naming the CPU-time spans."""
    report, _memory, _stderr, args, cwd = demo
    r = run_prism([a if a != "report.dir=report" else "report.dir=report_h100" for a in args[:args.index(RECIPE)]]
                  + ["mode=emulate", "cluster=h100_ib", *args[args.index(RECIPE):]], cwd=cwd, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    pred = json.loads((Path(cwd) / "report_h100" / "report.json").read_text())["predicted"]
    t = pred["throughput"]
    assert t["peak_bf16_tflops"] == 989.0
    assert t["mfu"] == pytest.approx(t["model_tflops_per_gpu"] / 989.0)
    assert t["mfu"] < 0.10 and "CPU time" in pred["mfu_warning"]
    assert "warning" in r.stderr and "below the plausible 10%-75%" in r.stderr
