"""The bundled DeepSpeed recipes under prism-launch on CPU (ZeRO-1/2/3, the pipeline engine,
MoE with expert parallelism): the capture agrees with a real run to 1e-5; emulation of a
sandbox rank that is not rank 0, and of two sandbox ranks at once, is bit-identical to the
capture in losses, grad norms and parameter checksums.

The jobs are started with the deepspeed launcher's flags (``--num_gpus``), so the scripts also
get ``--local_rank=N``; ZeRO-3's real run uses torchrun's flags. DeepSpeed's CPU ops are never
JIT-compiled here: the configs use ``"torch_adam": true`` and the compatibility module skips
the shared-memory communication op.
"""

import json

import pytest

from tests.conftest import EXAMPLES, logged_metrics, rank_lines, rank_log_dirs, run_prism

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'prism-launch[deepspeed]')")

CONFIGS = EXAMPLES / "ds_configs"
JOBS = {  # name: (ranks, recipe, config, sandboxes)
    "zero1": (4, "deepspeed_gpt.py", "zero1.json", [[2], [1, 3]]),
    "zero2": (4, "deepspeed_gpt.py", "zero2.json", [[3], [0, 2]]),
    "zero3": (4, "deepspeed_gpt.py", "zero3.json", [[3], [1, 2]]),
    "pipe": (4, "deepspeed_pipe.py", "pipe.json", [[3], [0, 3]]),
    "moe": (4, "deepspeed_moe.py", "moe.json", [[3], [0, 3]]),
}


def _script(name: str) -> list:
    _, recipe, config, _ = JOBS[name]
    return [EXAMPLES / recipe, "--deepspeed", "--deepspeed_config", CONFIGS / config, "--log-all-ranks"]


def _flags(nproc: int) -> list:
    return ["--num_gpus", str(nproc), "-r", "3", "device=cpu", "comm.timeout_s=120"]


@pytest.fixture(scope="module", params=list(JOBS))
def capture(request, tmp_path_factory):
    name = request.param
    nproc = JOBS[name][0]
    d = tmp_path_factory.mktemp(name)
    r = run_prism([*_flags(nproc), "--log-dir", d / "logs", "mode=capture", f"trace.dir={d / 'trace'}",
                   *_script(name)], cwd=d, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return name, d


def test_capture_agrees_with_real_run(capture, tmp_path):
    name, d = capture
    nproc = JOBS[name][0]
    flags = ["--nproc-per-node", str(nproc), *_flags(nproc)[2:]] if name == "zero3" else _flags(nproc)
    r = run_prism([*flags, "--log-dir", tmp_path / "logs", "mode=real", *_script(name)], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(nproc):
        real, cap = logged_metrics(rank_lines(tmp_path / "logs", rank)), logged_metrics(rank_lines(d / "logs", rank))
        assert len(real) == len(cap) >= 3
        for a, b in zip(real, cap):
            assert a["head"] == b["head"]
            for k in a.keys() - {"head"}:
                assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (name, rank, k, a[k], b[k])
    if name.startswith("zero"):
        header = [x for x in rank_lines(d / "logs", 0, "zero stage")]
        assert header and header[0].endswith("local_rank arg 0"), header  # --local_rank=0, as deepspeed passes it
        header = rank_lines(tmp_path / "logs", 0, "zero stage") if name == "zero3" else header
        assert name != "zero3" or header[0].endswith("local_rank arg -1")  # torchrun's flags: no --local_rank


def test_emulation_is_bit_identical(capture, tmp_path):
    name, d = capture
    nproc, _, _, sandboxes = JOBS[name]
    captured = json.loads((d / "trace" / "memory.json").read_text())
    for sandbox in sandboxes:
        out = tmp_path / "-".join(map(str, sandbox))
        r = run_prism([*_flags(nproc), "--log-dir", out / "logs", "mode=emulate", f"trace.dir={d / 'trace'}",
                       f"sandbox.ranks={json.dumps(sandbox)}", f"report.dir={out / 'report'}", *_script(name)],
                      cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        report = json.loads((out / "report" / "report.json").read_text())
        for rank in sandbox:
            emu, cap = logged_metrics(rank_lines(out / "logs", rank)), logged_metrics(rank_lines(d / "logs", rank))
            assert len(emu) >= 3
            assert emu == cap, (name, sandbox, rank)  # exact float equality: bit-identical
            entry = report["ranks"][str(rank)]
            assert entry["divergences"] == []
            assert entry["ops"] > 10
            # the sandbox's peak is the captured rank's, though its ops complete at the modelled lags
            # (emulate.timing=predicted): nothing of a completed op stays alive. ZeRO-3 itself is not
            # exact from run to run: in three real runs (mode=real) rank 3 peaked at 1,825,861 or
            # 1,841,473 B (+0.86%: what is alive at the peak moment follows the timing of its
            # collectives), ranks 0-2 likewise; its emulated sandboxes 508-512 B or 16-18 KB (0.99%,
            # one sandbox or two) over their capture. ZeRO-1/2 to the byte on an idle machine. So
            # 2%: a held op result (the 400 KB of DeepSpeed's prefetcher once, 22%) still fails.
            # Seen otherwise: the pipeline engine's sandbox 64 KiB (0.002%) under its capture; MoE with two sandboxes exact, 3,880 B (0.13%) and 16,384 B (0.5%)
            # over in three runs (a sandbox's tensor sent to the other sandbox is held until that
            # peer receives it, as a real backend holds it: when is timing)
            peak, want = entry["peak_memory_bytes"], captured[str(rank)]["peak_bytes"]
            if not name.startswith("zero"):
                tolerance = 1e-2 * want
            elif name == "zero3" or len(sandbox) > 1:
                tolerance = 2e-2 * want
            else:
                tolerance = 4096
            assert abs(peak - want) <= tolerance, (name, sandbox, rank, peak, want)
        # the virtual ranks never ran: only the sandbox ranks and the assistant (logged under the world size) did
        [run_dir] = list((out / "logs").iterdir())
        assert rank_log_dirs(run_dir) == sorted(sandbox) + [nproc]
        assert sorted(int(r) for r, v in report["ranks"].items() if not v["sandbox"]) == \
            sorted(set(range(nproc)) - set(sandbox))


def _capture_and_emulate(tmp_path, world: int, sandbox: int, script: list, extra: tuple = ()) -> tuple[list, list, dict]:
    flags = ["--nnodes", str(world // 8), "--nproc-per-node", "8", "-r", "3", "device=cpu", "comm.timeout_s=120",
             "capture.fold=true", f"sandbox.ranks=[{sandbox}]", f"trace.dir={tmp_path / 'trace'}", *extra]
    r = run_prism([*flags, "--log-dir", tmp_path / "cap", "mode=capture", *script], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "captured 1 of" in r.stderr  # folded to the sandbox alone: rank 0 is not captured
    r = run_prism([*flags, "--log-dir", tmp_path / "emu", "mode=emulate", f"report.dir={tmp_path / 'rep'}", *script],
                  cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    return rank_lines(tmp_path / "cap", sandbox), rank_lines(tmp_path / "emu", sandbox), report


def test_zero3_in_a_1024_rank_world_without_rank_0(tmp_path):
    """ZeRO-3's consistency broadcasts from rank 0, which a folded capture of rank 1001 does not
    run: its stand-in serves them (the same code on CUDA, where the compat layer is active too)."""
    cap, emu, report = _capture_and_emulate(tmp_path, 1024, 1001, [*_script("zero3")])
    assert len(logged_metrics(cap)) >= 3 and logged_metrics(emu) == logged_metrics(cap)
    entry = report["ranks"]["1001"]
    assert entry["losses_match_capture"] is True and entry["divergences"] == []
    assert report["virtual_ranks"] == 1023
    [line] = [x for x in emu if x.startswith("prism-launch: deepspeed memory rank 1001 ")]
    mem = json.loads(line.split(" ", 5)[5])
    assert mem["zero_stage"] == 3 and mem["dp_world_size"] == 1024 and mem["zero3_partition_bytes"] > 0
    assert set(mem["buckets"]) == {"reduce_bucket", "stage3_prefetch_bucket", "stage3_max_live_parameters"}
    assert mem["optimizer_state_bytes"] and mem["offload"] == {"optimizer": "none", "param": "none"}
    assert entry["memory_details"]["deepspeed"] == mem  # in report.json, as in the rank's log


def test_zero3_with_payload_none_at_1024_ranks(tmp_path):
    """The lean payload policy with DeepSpeed (ZeRO-3's parameter all-gathers are the bulk of its
    traffic): no tensors recorded, the results synthesized alike in capture and emulation, so the
    sandbox's logged numbers equal its own capture's; the report says so."""
    cap, emu, report = _capture_and_emulate(tmp_path, 1024, 1001, [*_script("zero3")], ("capture.payload=none",))
    assert len(logged_metrics(cap)) >= 3 and logged_metrics(emu) == logged_metrics(cap)
    entry = report["ranks"]["1001"]
    assert entry["losses_match_capture"] is True and entry["divergences"] == []
    assert report["payload"]["policy"] == "none" and entry["synthesized"] > 0
    # what the trace holds: only the payloads of carried broadcasts (DeepSpeed broadcasts each
    # parameter from rank 0 at start-up: control data up to capture.carry_bytes), never a contribution
    import pyarrow.parquet as pq

    index = tmp_path / "trace" / "tensors" / "index.parquet"
    keys = [row["key"] for row in pq.read_table(index).to_pylist()] if index.exists() else []
    assert all(k.startswith("r/") for k in keys) and entry["carried"] >= len(keys)
    assert entry["memory_details"]["deepspeed"]["zero_stage"] == 3


DSE = EXAMPLES.parent / "third_party" / "DeepSpeedExamples" / "training" / "bf16_master_weight" / "train.py"


@pytest.mark.skipif(not DSE.exists(), reason="DeepSpeedExamples is not fetched into third_party/ (see bench/gpu_deepspeed.py)")
def test_unchanged_deepspeedexamples_script_at_64_ranks(tmp_path):
    """DeepSpeedExamples' training/bf16_master_weight/train.py (ZeRO-3, bf16, generated tokens),
    copied unchanged: its ``local_rank`` is the global rank 37 (torchrun's flags), which it gives
    to ``torch.cuda.set_device`` and ``get_accelerator().device_name``."""
    import shutil

    script = tmp_path / "train.py"
    shutil.copyfile(DSE, script)
    args = [script, "--deepspeed_config", CONFIGS / "dse_zero3_bf16.json", "--hidden_dim", "64", "--num_layers", "2",
            "--num_heads", "4", "--vocab_size", "512", "--batch_size", "2", "--seq_length", "16", "--num_steps", "4",
            "--warmup_steps", "1", "--log_interval", "1"]
    cap, emu, report = _capture_and_emulate(tmp_path, 64, 37, args)
    steps = [line for line in cap if "Step" in line and "loss=" in line]
    assert len(steps) == 4
    entry = report["ranks"]["37"]
    assert entry["losses_match_capture"] is True and len(entry["losses"]) == 4 and entry["divergences"] == []
    assert [line.split(", time=")[0] for line in emu if "loss=" in line] == [s.split(", time=")[0] for s in steps]
