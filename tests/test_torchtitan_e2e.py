"""torchtitan's llama3 debug model through its unchanged entry point (``-m torchtitan.train``)
under prism-launch on CPU: FSDP over 8 ranks is captured, and a sandbox rank that is not rank 0
is emulated against the trace with the capture's losses. The tokenizer and the dataset are
written locally (examples/torchtitan/make_assets.py); nothing is downloaded.

The job runs with ``--debug.seed``: without it torchtitan's rank 0 draws the base seed, so two
captures of the same command differ (with it, two captures are bit-identical, with and without
``capture.exchange``).

The emulated rank is bit-identical to its capture: the same losses, no divergence of any kind;
likewise TP2 x FSDP512 and PP2 x FSDP256 x TP2 over 1,024 ranks (folded to the sandbox's
model-parallel peers), CP2 x FSDP4 and CP2 x TP2 x FSDP2 at 8 ranks; and a 4-point sweep of
tp x dp_shard at 8 ranks.
(The capture counts step 2's FLOPs under torch's FlopCounterMode, which would decompose
``silu_backward`` into separately rounded bfloat16 ops and change that step's gradients in the
last bits: prism_launch/rank/flops.py runs the program's own kernels while counting.)
"""

import json

import pytest

from tests.conftest import EXAMPLES, rank_lines, run_prism

pytest.importorskip("tokenizers", reason="torchtitan is not installed (pip install 'prism-launch[torchtitan]')")
if __import__("importlib.util").util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed (pip install 'prism-launch[torchtitan]')", allow_module_level=True)

import re  # noqa: E402

_LOSS = re.compile(r"step:\s+(\d+)\s+\S*loss:\s+(\S+)")


def _losses(lines):
    return [m.groups() for m in map(_LOSS.search, lines) if m]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_assets", EXAMPLES / "torchtitan" / "make_assets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_assets(tmp_path_factory.mktemp("assets"))


def _script(assets, out):
    tok, data = assets
    return ["-m", "torchtitan.train", "--model.name", "llama3", "--model.flavor", "debugmodel",
            "--model.hf_assets_path", tok, "--training.dataset_path", data, "--training.steps", "3",
            "--training.local_batch_size", "1", "--training.seq_len", "64", "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--debug.seed", "7", "--job.dump_folder", out]


def _offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def _capture_and_emulate(assets, tmp_path, monkeypatch, world, parallelism, sandbox, captured_msg, timeout=400):
    """Capture torchtitan with the prism-launch flags ``world`` and torchtitan's ``parallelism``,
    check the launcher said ``captured_msg``, emulate rank ``sandbox`` alone and check it is
    bit-identical to its capture (equal losses that change, no divergence of any kind); returns
    the report, the rank's entry and its captured log lines."""
    _offline(tmp_path, monkeypatch)
    base = [*world, "device=cpu", "comm.timeout_s=300", f"sandbox.ranks=[{sandbox}]", f"trace.dir={tmp_path / 'trace'}"]
    r = run_prism([*base, "--log-dir", tmp_path / "cap", "mode=capture", *_script(assets, tmp_path / "o1"),
                   *parallelism], cwd=tmp_path, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    assert captured_msg in r.stderr
    r = run_prism([*base, "--log-dir", tmp_path / "emu", "mode=emulate", f"report.dir={tmp_path / 'rep'}",
                   *_script(assets, tmp_path / "o2"), *parallelism], cwd=tmp_path, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    captured = rank_lines(tmp_path / "cap", sandbox)
    cap, emu = _losses(captured), _losses(rank_lines(tmp_path / "emu", sandbox))
    assert len(cap) == 3 and emu == cap, (emu, cap)
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    rank = report["ranks"][str(sandbox)]
    assert rank["losses"] == rank["captured_losses"] and rank["losses_match_capture"], rank["losses"]
    assert len(set(rank["losses"])) == 3  # it trains
    assert rank["divergence_counts"] == {"value": 0, "tolerance": 0, "host_scalar": 0}, rank["divergences"][:3]
    return report, rank, captured


EIGHT = ["--nproc-per-node", "8"]
FOLDED_1024 = ["--nnodes", "128", "--nproc-per-node", "8", "-r", "3", "capture.fold=true"]


@pytest.mark.slow
def test_fsdp_8_ranks_capture_and_emulate(assets, tmp_path, monkeypatch):
    report, rank, _ = _capture_and_emulate(assets, tmp_path, monkeypatch, EIGHT, [], 3, "captured 8 logical ranks")
    assert report["virtual_ranks"] == 7 and rank["ops"] > 50


def test_fsdp_tp_1024_ranks_folded(assets, tmp_path, monkeypatch):
    """TP2 x FSDP512 over 1,024 ranks, folded to the sandbox's tensor-parallel pair: rank 101
    (FSDP index 50: its parameter shards are not padding) emulated bit for bit against its capture.
    Folding follows tp and not the data-parallel meshes by capture.replicated_groups' defaults.
    Loss parallelism is off (on CPU, DTensor's loss-parallel path moves targets to 'cuda')."""
    tp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"]
    report, rank, _ = _capture_and_emulate(assets, tmp_path, monkeypatch, FOLDED_1024, tp, 101,
                                           "captured 2 of 1024 logical ranks (folded)")
    assert report["virtual_ranks"] == 1023 and rank["ops"] > 100


def test_fsdp_tp_pp_1024_ranks_folded(assets, tmp_path, monkeypatch):
    """PP2 x FSDP256 x TP2 over 1,024 ranks (torchtitan's 1F1B over 2 micro-batches), folded to
    the sandbox's pipeline and tensor-parallel peers: rank 613 (last stage, FSDP index 50, TP
    rank 1) logs the losses and is emulated bit for bit against its capture."""
    par = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.disable_loss_parallel", "--training.local_batch_size", "2"]
    report, rank, _ = _capture_and_emulate(assets, tmp_path, monkeypatch, FOLDED_1024, par, 613,
                                           "captured 4 of 1024 logical ranks (folded)")
    assert report["virtual_ranks"] == 1023 and rank["p2p"], rank.get("p2p")
    assert report["predicted"]["throughput"]["tokens_per_step"] == 256 * 2 * 64  # local batch 2 x DP 256 x seq 64


def test_sweep_dp_shard_by_tp(assets, tmp_path, monkeypatch):
    """A 4-point sweep of the layout at 8 ranks: target.parallel.tp=1,2,4,8 rendered into
    --parallelism.tensor_parallel_degree, the data-parallel shard degree into what the world
    leaves (8, 4, 2, 1); each point captured folded and emulated, ranked in summary.csv with
    torchtitan's tokens per step."""
    import csv

    _offline(tmp_path, monkeypatch)
    sweep = tmp_path / "sweep"
    r = run_prism(["--multirun", "--nproc-per-node", "8", "-r", "3", "device=cpu", "comm.timeout_s=120",
                   "capture.fold=true", "sandbox.ranks=[0]", f"hydra.sweep.dir={sweep}", "target.parallel.tp=1,2,4,8",
                   *_script(assets, tmp_path / "o"), "--parallelism.disable_loss_parallel"],
                  cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert sorted(row["overrides"] for row in rows) == [f"target.parallel.tp={t}" for t in (1, 2, 4, 8)]
    assert all(row["status"] == "ok" for row in rows), rows
    for row in rows:
        tp = int(row["overrides"].rsplit("=", 1)[1])
        assert f"--parallelism.tensor_parallel_degree {tp}" in row["script_args"]
        assert f"--parallelism.data_parallel_shard_degree {8 // tp}" in row["script_args"]
        tokens = float(row["tokens_per_s"]) * float(row["iteration_time_s"])
        assert round(tokens) == (8 // tp) * 64, tokens  # local batch 1 x dp_shard x seq 64
        assert float(row["iteration_time_s"]) > 0 and float(row["tokens_per_s_per_gpu"]) > 0


@pytest.mark.slow
def test_cp_fsdp_8_ranks_capture_and_emulate(assets, tmp_path, monkeypatch):
    """CP2 x FSDP4 at 8 ranks: torchtitan's context parallelism (torch's ring attention over SDPA's
    CPU flash op, integrations/torchtitan_cp.py; head-tail load balancing) is captured, and rank 3
    (FSDP index 1, CP rank 1) is emulated bit for bit: its ring exchanges come from the trace."""
    report, rank, captured = _capture_and_emulate(assets, tmp_path, monkeypatch, EIGHT,
                                                  ["--parallelism.context_parallel_degree", "2"], 3,
                                                  "captured 8 logical ranks")
    assert report["virtual_ranks"] == 7 and rank["ops"] > 50
    assert any("Applied Context Parallel" in line for line in captured), captured[-20:]


@pytest.mark.slow
def test_cp_tp_fsdp_8_ranks_capture_and_emulate(assets, tmp_path, monkeypatch):
    """CP2 x TP2 x FSDP2 at 8 ranks (mesh dp_shard x cp x tp): ring attention over the heads each
    tensor-parallel rank holds; rank 7 (FSDP index 1, CP rank 1, TP rank 1) emulated bit for bit.
    Loss parallelism is off (on CPU, DTensor's loss-parallel path moves targets to 'cuda')."""
    par = ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
           "--parallelism.disable_loss_parallel"]
    report, rank, captured = _capture_and_emulate(assets, tmp_path, monkeypatch, EIGHT, par, 7,
                                                  "captured 8 logical ranks")
    assert report["virtual_ranks"] == 7 and rank["ops"] > 50
    assert any("dp_shard=2, cp=2, tp=2" in line for line in captured), captured[:20]
    assert any("Applied Context Parallel" in line for line in captured), captured[-20:]


def test_torch_compile_fsdp_2_ranks_capture_and_emulate(assets, tmp_path, monkeypatch):
    """--compile.enable (torchtitan compiles each block and the loss; on CPU, inductor's C++
    backend): the compiled program is captured and rank 1 emulated bit for bit. The capture
    does not count its FLOPs (a dispatch mode would stop compiled frames): the report takes
    torchtitan's own count instead and says why."""
    report, rank, _ = _capture_and_emulate(assets, tmp_path, monkeypatch, ["--nproc-per-node", "2"],
                                           ["--compile.enable"], 1, "captured 2 logical ranks", timeout=600)
    assert any("Compiling each TransformerBlock with torch.compile" in line for line in rank_lines(tmp_path / "emu", 1))
    t = report["predicted"]["throughput"]
    assert "torch.compile" in t["flops_source"] and "torchtitan's own count" in t["flops_source"], t["flops_source"]
    assert t["model_flops_per_step"] == 35_016_192 * 128  # debugmodel at seq 64: its trainer's FLOPs/token x 2 x 64


def test_tp4_positions_sampled_without_payloads(assets, tmp_path, monkeypatch):
    """TP4 x FSDP4 over 16 ranks, ``payload=none``, folded: torchtitan's ``tp`` mesh dimension is
    sampled (``capture.tp_sample``: TP positions 0 and the sandbox's 3), 2 ranks captured, not 4; each
    TP rank left out does, op for op, what its stand-in does in a capture of the whole TP group.
    (A run of both in the default mode=auto: docs/benchmarks.md, the same counted FLOPs per step.)"""
    from prism_launch.trace import TraceReader

    _offline(tmp_path, monkeypatch)
    par = ["--parallelism.tensor_parallel_degree", "4", "--parallelism.disable_loss_parallel"]
    base = ["--nnodes", "2", "--nproc-per-node", "8", "device=cpu", "comm.timeout_s=300", "capture.fold=true",
            "capture.payload=none", "sandbox.ranks=[15]", "mode=capture"]
    traces = {}
    for name, sample in (("sampled", 2), ("whole", 0)):
        traces[name] = tmp_path / name
        r = run_prism([*base, f"capture.tp_sample={sample}", f"trace.dir={traces[name]}",
                       *_script(assets, tmp_path / f"o-{name}"), *par], cwd=tmp_path, timeout=400)
        assert r.returncode == 0, r.stderr[-4000:]
    fold = json.loads((traces["sampled"] / "fold.json").read_text())
    assert fold["captured"] == [12, 15] and fold["tp_positions"] == [0, 3]
    assert json.loads((traces["whole"] / "fold.json").read_text())["captured"] == [12, 13, 14, 15]

    def ops(reader, rank):
        groups = {int(g["id"]): g for g in reader.manifest.groups}
        return [(e["kind"], e["op"], e["nbytes"], groups[int(e["group"])].get("desc") if int(e["group"]) in groups
                 else None) for e in reader.events_for_rank(rank)]

    sampled, whole = TraceReader(traces["sampled"]), TraceReader(traces["whole"])
    for rank in (12, 13, 14, 15):
        assert ops(whole, rank) == ops(sampled, fold["rep"][rank]), rank
