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

from tests.conftest import EXAMPLES, logged_metrics, rank_lines, run_prism

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
        assert report["virtual_ranks"] == nproc - len(sandbox)
