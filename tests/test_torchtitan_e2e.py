"""torchtitan's llama3 debug model through its unchanged entry point (``-m torchtitan.train``)
under prism-launch on CPU: FSDP over 8 ranks is captured, and a sandbox rank that is not rank 0
is emulated against the trace with the capture's losses. The tokenizer and the dataset are
written locally (examples/torchtitan/make_assets.py); nothing is downloaded.

The job runs with ``--debug.seed``: without it torchtitan's rank 0 draws the base seed, so two
captures of the same command differ (with it, two captures are bit-identical, with and without
``capture.exchange``).

Known gap: the first training step is bit-identical (no divergence), and every result the sandbox
receives through step 2's first gradient reduce-scatter (all-gathers, reduce-scatters,
all-reduces) equals the capture's bit for bit; from step 2's second reduce-scatter on, the
sandbox's own transformer-block gradients differ from the recorded ones by one bfloat16 ulp in
~18% of their elements (the output layer's and the embedding's gradients stay identical), so
bit-identity from step 2 on is not yet asserted. Ruled out: thread counts (1 intra-op, 2 inter-op
in both), oneDNN (``torch.backends.mkldnn.enabled=False``: the same divergences), activation
checkpointing (``--activation_checkpoint.mode none``: the same), the shared-memory exchange.
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


@pytest.mark.slow
def test_fsdp_8_ranks_capture_and_emulate(assets, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    base = ["--nproc-per-node", "8", "device=cpu", "comm.timeout_s=120", f"trace.dir={tmp_path / 'trace'}"]
    r = run_prism([*base, "--log-dir", tmp_path / "cap", "mode=capture", *_script(assets, tmp_path / "o1")],
                  cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "captured 8 logical ranks" in r.stderr
    r = run_prism([*base, "--log-dir", tmp_path / "emu", "mode=emulate", "sandbox.ranks=[3]",
                   f"report.dir={tmp_path / 'rep'}", *_script(assets, tmp_path / "o2")],
                  cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    cap, emu = _losses(rank_lines(tmp_path / "cap", 3)), _losses(rank_lines(tmp_path / "emu", 3))
    # torchtitan prints losses to 5 decimals: equal while the last-bit gradient differences
    # (see the module docstring) have not yet moved them, then within 1e-3
    assert len(cap) == 3 and [s for s, _ in emu] == [s for s, _ in cap] and emu[:2] == cap[:2], (emu, cap)
    assert all(abs(float(a) - float(b)) < 1e-3 for (_, a), (_, b) in zip(emu, cap)), (emu, cap)
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["virtual_ranks"] == 7 and report["ranks"]["3"]["ops"] > 50
    # the only divergences are last-bit differences in gradient reductions, never a different op,
    # and none in the first step (report steps count from 0)
    for d in report["ranks"]["3"]["divergences"]:
        assert d["step"] >= 1, d
        assert d["kind"] in ("value", "tolerance") and d["max_abs_diff"] < 1e-3, d
