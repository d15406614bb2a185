"""The command line: torchrun's flags and spellings, overrides, config printing, env."""

import json

import pytest

from prism_launch.launch.args import parse
from tests.conftest import ROOT, WORKERS, run_prism, run_torchrun


def test_help_shows_torchrun_flags():
    r = run_prism(["--help"], cwd=ROOT)
    assert r.returncode == 0
    for flag in ("--nnodes", "--nproc-per-node", "--standalone", "--node-rank", "--master-addr", "--master-port",
                 "--rdzv-backend", "--rdzv-endpoint", "--max-restarts", "--no-python", "--log-dir", "--redirects",
                 "--tee", "--module", "--cfg", "mode=capture"):
        assert flag in r.stdout, flag


def test_overrides_sit_between_flags_and_script():
    a = parse(["--nnodes=2", "--nproc_per_node", "4", "mode=emulate", "sandbox.ranks=[5]", "train.py",
               "--lr", "1", "x=y"])
    assert a.overrides == ["mode=emulate", "sandbox.ranks=[5]"]
    assert (a.script, a.script_args) == ("train.py", ["--lr", "1", "x=y"])
    assert (a.nnodes, a.nproc_per_node) == (2, 4)


def test_underscore_spellings_and_pet_env(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_NNODES", "1:5")
    a = parse(["--master_port", "1234", "t.py"])
    assert a.nproc_per_node == 3 and a.nnodes == 5 and a.torchrun.master_port == 1234


def test_module_and_no_python_are_exclusive():
    with pytest.raises(SystemExit):
        parse(["-m", "--no-python", "x"])


def test_print_config_reflects_flags_and_overrides(tmp):
    r = run_prism(["--nnodes", "2", "--nproc-per-node", "8", "--cfg", "mode=emulate", "sandbox.ranks=[3,9]",
                   "device=cpu", "x.py"], cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert "mode: emulate" in r.stdout and "world_size: 16" in r.stdout and "- 9" in r.stdout


def test_world_size_override(tmp):
    r = run_prism(["--nproc-per-node", "2", "--cfg", "target.world_size=1024", "device=cpu", "x.py"], cwd=tmp)
    assert "world_size: 1024" in r.stdout


def _envs(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        if "ENV " in line:
            d = json.loads(line.split("ENV ", 1)[1])
            out[int(d["RANK"])] = d
    return out


def test_rank_environment_matches_torchrun(tmp):
    flags = ["--nnodes", "1", "--nproc-per-node", "3", "--max-restarts", "0"]
    ours = run_prism([*flags, "mode=real", "device=cpu", WORKERS / "dump_env.py", "a", "b"], cwd=tmp, timeout=120)
    theirs = run_torchrun([*flags, "--tee", "3", WORKERS / "dump_env.py", "a", "b"], cwd=tmp, timeout=120)
    assert ours.returncode == 0, ours.stderr
    assert theirs.returncode == 0, theirs.stderr
    mine, ref = _envs(ours.stdout), _envs(theirs.stdout)
    assert sorted(mine) == sorted(ref) == [0, 1, 2]
    varying = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}
    for r in ref:
        for k, v in ref[r].items():
            if k not in varying:
                assert mine[r][k] == v, (r, k, mine[r][k], v)
        assert mine[r]["TORCHELASTIC_ERROR_FILE"].endswith(f"/{r}/error.json")


def test_module_form_runs_like_python_dash_m(tmp):
    r = run_prism(["--nproc-per-node", "2", "mode=auto", "device=cpu", "emulate.timing=none",
                   f"trace.dir={tmp / 'tr'}", "-m", "pkg.train"], cwd=tmp,
                  env={"PYTHONPATH": str(WORKERS)})
    assert r.returncode == 0, r.stderr
    assert "MODULE rank 0 name __main__ sum 3.0" in r.stdout


def test_no_python_runs_the_command(tmp):
    r = run_prism(["--nproc-per-node", "2", "--no-python", "mode=real", "device=cpu",
                   WORKERS / "dump_env.sh", "hello"], cwd=tmp)
    assert r.returncode == 0, r.stderr
    envs = _envs(r.stdout)
    assert sorted(envs) == [0, 1] and envs[1]["args"] == "hello" and envs[1]["WORLD_SIZE"] == "2"


def test_no_python_capture_and_emulate_hook_the_python_it_starts(tmp):
    script = tmp / "run.sh"
    script.write_text(f"#!/bin/sh\nexec python -m pkg.train\n")
    script.chmod(0o755)
    import sys

    env = {"PYTHONPATH": str(WORKERS), "PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin"}
    r = run_prism(["--nproc-per-node", "2", "--no-python", "mode=auto", "device=cpu", "emulate.timing=none",
                   "sandbox.ranks=[1]", f"trace.dir={tmp / 'tr'}", script], cwd=tmp, env=env)
    assert r.returncode == 0, r.stderr
    assert "MODULE rank 1 name __main__ sum 3.0" in r.stdout
    # the hook ends the rank as bootstrap does: memory figures in, op threads joined
    summary = json.loads((tmp / "tr" / "report" / "sandbox" / "rank1.json").read_text())
    assert summary["memory"]["peak_bytes"] > 0
    assert summary["helper_threads"] >= 1 and summary["in_flight_at_close"] == []


@pytest.mark.parametrize(("override", "message"), [
    ("emulate.prefetch.pool_mib=0", "emulate.prefetch.pool_mib must be >= 1"),
    ("emulate.prefetch.reserve_gib=-1", "emulate.prefetch.reserve_gib must be >= 0"),
    ("emulate.prefetch.threads=0", "emulate.prefetch.threads must be >= 1"),
    ("emulate.prefetch.host_tier_gib=-1", "emulate.prefetch.host_tier_gib must be >= 0"),
    ("emulate.prefetch.mode=eager", "emulate.prefetch.mode"),
    ("emulate.data_path=gpu", "emulate.data_path"),
])
def test_bad_prefetch_settings_are_named(tmp, override, message):
    r = run_prism(["--nproc-per-node", "2", "device=cpu", override, "x.py"], cwd=tmp)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
