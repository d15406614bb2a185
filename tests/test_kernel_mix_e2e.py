"""``calibrate.kernel_mix``: a calibration of the bundled megatron-core recipe (TP2, 2 ranks, CPU)
profiles each slice's first steady step (left out of the pooled steps); the calibrated manifest carries the shard class's kernel mix
(on CPU: torch's ops; on CUDA: the kernels, which scale the spans to the cluster's GPU)."""

import json

from prism_launch.trace import TraceReader
from tests.conftest import EXAMPLES, run_prism

ARGS = [EXAMPLES / "megatron_gpt.py", "--tensor-model-parallel-size", "2", "--train-iters", "4"]


def test_calibration_records_each_shard_class_kernel_mix(tmp_path):
    common = ["--nproc-per-node", "2", "device=cpu", "comm.timeout_s=120", f"trace.dir={tmp_path / 'trace'}"]
    r = run_prism([*common, "mode=capture", *ARGS], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_prism([*common, "mode=calibrate", "calibrate.kernel_mix=true", "calibrate.repeats=1", *ARGS],
                  cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    extra = TraceReader(tmp_path / "trace" / "calibrated").manifest.extra
    assert extra["kernel_mix_errors"] == []
    [mix] = extra["kernel_mixes"]  # the two TP ranks are one shard class
    assert mix["members"] == [0, 1] and mix["activity"] == "cpu ops"
    assert 0 < mix["compute"] < 1 and 0 < mix["memory"] < 1 and mix["compute"] + mix["memory"] + mix["comm"] <= 1
    assert "aten::mm" in {name for name, _ in mix["longest"]} or mix["compute"] > 0.01
    assert mix["kernel_s"] > 0 and 0 < mix["busy_share"] <= 1 and mix["steady_step_s"] > 0
    # the three steady steps issue the same events: the profiled one gives no sample, every span
    # is the median over the other two
    [cls] = extra["shard_classes"]
    assert cls["steady_steps_pooled"] == 2 and cls["profiled_steps_left_out"] == 1 and cls["measurements"] == 1
    # without the option nothing is profiled
    r = run_prism([*common, "mode=calibrate", "calibrate.repeats=1", *ARGS], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    plain = TraceReader(tmp_path / "trace" / "calibrated").manifest.extra
    assert "kernel_mixes" not in plain and plain["shard_classes"][0]["steady_steps_pooled"] == 3
    assert json.loads(json.dumps(extra["shard_classes"]))
