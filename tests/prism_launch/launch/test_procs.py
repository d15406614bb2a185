"""Tests for prism_launch.launch.procs (rank-process manager), fork and spawn."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prism_launch.launch.procs import RankProcesses, RanksTimeoutError, RankSpec, RunResult, Std

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
WORKER = HERE / "procs_worker.py"
LAUNCHER = HERE / "procs_launcher.py"

_spec = importlib.util.spec_from_file_location("_prism_procs_worker", WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

METHODS = ["fork", "spawn"]


# --------------------------------------------------------------------------- helpers


def boom_in_forked_rank() -> None:
    raise ValueError(f"boom from rank {os.environ['RANK']}")


def fork_target(spec: RankSpec) -> int:
    mode, arg = spec.env["MODE"], spec.env.get("ARG", "")
    if mode == "raise":
        boom_in_forked_rank()
    return worker.main(["worker", mode, arg])


def make_procs(
    method: str,
    tmp_path: Path,
    modes: dict[int, tuple[str, str]],
    *,
    redirects: Std | dict[int, Std] = Std.ALL,
    tee: Std | dict[int, Std] = Std.NONE,
    teardown_timeout_s: float = 5.0,
) -> RankProcesses:
    specs = []
    for rank, (mode, arg) in modes.items():
        env = {"RANK": str(rank), "MODE": mode, "ARG": arg}
        argv = [sys.executable, str(WORKER), mode, arg] if method == "spawn" else None
        specs.append(RankSpec(rank=rank, env=env, argv=argv))
    return RankProcesses(
        specs,
        start_method=method,  # type: ignore[arg-type]
        target=fork_target if method == "fork" else None,
        log_dir=tmp_path / "logs",
        redirects=redirects,
        tee=tee,
        teardown_timeout_s=teardown_timeout_s,
    )


def alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (init in a container may not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until(pred, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def assert_reaped(pids: dict[int, int]) -> None:
    for rank, pid in pids.items():
        assert not alive(pid), f"rank {rank} (pid {pid}) survived"
        with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
            os.waitpid(pid, os.WNOHANG)


def run(procs: RankProcesses, timeout_s: float = 20.0) -> RunResult:
    with procs:
        procs.start()
        pids = procs.pids
        result = procs.wait(timeout_s)
    assert_reaped(pids)
    return result


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("method", METHODS)
def test_all_ok_env_and_error_file_var(method: str, tmp_path: Path) -> None:
    out = {r: tmp_path / f"env{r}.json" for r in range(2)}
    procs = make_procs(method, tmp_path, {r: ("env", str(out[r])) for r in range(2)})
    result = run(procs)
    assert result.ok and result.failures == {} and result.first_failure is None
    assert result.exitcodes == {0: 0, 1: 0}
    for r in range(2):
        env = json.loads(out[r].read_text())
        assert env["RANK"] == str(r)
        assert env["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "logs" / str(r) / "error.json")
        assert "PATH" in env  # launcher environment is inherited


@pytest.mark.parametrize("method", METHODS)
def test_one_rank_raises_tears_down_the_others(method: str, tmp_path: Path) -> None:
    procs = make_procs(method, tmp_path, {0: ("sleep", ""), 1: ("raise", ""), 2: ("sleep", "")})
    t0 = time.monotonic()
    result = run(procs)
    assert time.monotonic() - t0 < 10
    assert not result.ok
    assert set(result.failures) == {1}
    f = result.failures[1]
    assert f.rank == 1 and f.exitcode == 1 and f.signal is None
    assert f.error_file == tmp_path / "logs" / "1" / "error.json"
    assert f.message == "ValueError: boom from rank 1"
    assert f.traceback is not None and "Traceback" in f.traceback
    assert ("boom_in_forked_rank" if method == "fork" else "boom_in_spawned_worker") in f.traceback
    assert result.first_failure is f
    assert result.exitcodes[1] == 1
    assert result.exitcodes[0] == result.exitcodes[2] == -signal.SIGTERM
    stderr_log = (tmp_path / "logs" / "1" / "stderr.log").read_text()
    assert "ValueError: boom from rank 1" in stderr_log


def test_spawned_torch_record_writes_error_file(tmp_path: Path) -> None:
    result = run(make_procs("spawn", tmp_path, {0: ("record", "")}))
    f = result.failures[0]
    assert f.error_file is not None and f.message == "ValueError: boom from rank 0"
    assert f.traceback is not None and "boom_in_spawned_worker" in f.traceback


@pytest.mark.parametrize("method", METHODS)
def test_exit_code_and_stderr_tail_without_error_file(method: str, tmp_path: Path) -> None:
    err = tmp_path / "logs" / "0" / "error.json"
    err.parent.mkdir(parents=True)
    err.write_text('{"message": "stale from a previous attempt"}')
    result = run(make_procs(method, tmp_path, {0: ("exit", "3"), 1: ("sleep", "")}))
    f = result.failures[0]
    assert (f.exitcode, f.signal, f.error_file) == (3, None, None)
    assert f.message == "exited with code 3: exiting with 3"
    assert f.traceback == "exiting with 3"
    assert not err.exists()


@pytest.mark.parametrize("method", METHODS)
def test_sigterm_ignoring_rank_is_sigkilled(method: str, tmp_path: Path) -> None:
    procs = make_procs(
        method, tmp_path, {0: ("ignore_term", ""), 1: ("sleep", "")}, teardown_timeout_s=0.5
    )
    with procs:
        procs.start()
        pids = procs.pids
        ready = tmp_path / "logs" / "0" / "stdout.log"
        assert wait_until(lambda: "ignoring SIGTERM" in ready.read_text(), 10)
        assert procs.poll() is None
        os.kill(pids[1], signal.SIGKILL)  # rank 1 dies of a signal -> failure
        t0 = time.monotonic()
        result = procs.wait(10)
        elapsed = time.monotonic() - t0
    assert_reaped(pids)
    assert 0.4 <= elapsed < 3.0
    assert set(result.failures) == {1}
    assert result.failures[1].signal == "SIGKILL" and result.failures[1].exitcode == -signal.SIGKILL
    assert result.failures[1].message.startswith("killed by SIGKILL")
    assert result.exitcodes[0] == -signal.SIGKILL


@pytest.mark.parametrize("method", METHODS)
def test_launcher_death_kills_ranks(method: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    launcher = subprocess.Popen(
        [sys.executable, str(LAUNCHER), method, str(tmp_path / "logs"), str(pid_file)], env=env
    )
    try:
        assert wait_until(pid_file.exists, 20), "launcher did not start its ranks"
        pids = json.loads(pid_file.read_text())["ranks"]
        assert len(pids) == 2 and all(alive(p) for p in pids.values())
        launcher.kill()
        launcher.wait(10)
        assert wait_until(lambda: not any(alive(p) for p in pids.values()), 5), "orphaned ranks survived"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


@pytest.mark.parametrize("method", METHODS)
def test_redirect_writes_logs_only(method: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    result = run(make_procs(method, tmp_path, {0: ("lines", "3"), 1: ("lines", "3")}))
    assert result.ok
    captured = capfd.readouterr()
    assert "rank" not in captured.out and "rank" not in captured.err
    for r in range(2):
        out = (tmp_path / "logs" / str(r) / "stdout.log").read_text().splitlines()
        err = (tmp_path / "logs" / str(r) / "stderr.log").read_text().splitlines()
        assert out == [f"rank{r} out {i}" for i in range(3)] + [f"rank{r} c-level"]
        assert err == [f"rank{r} err {i}" for i in range(3)]


@pytest.mark.parametrize("method", METHODS)
def test_tee_prefixes_lines_without_interleaving(
    method: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    n = 300
    procs = make_procs(method, tmp_path, {r: ("lines", str(n)) for r in range(3)}, redirects=Std.NONE, tee=Std.ALL)
    assert run(procs).ok
    captured = capfd.readouterr()
    for stream, kind in ((captured.out, "out"), (captured.err, "err")):
        seen: dict[int, list[str]] = {0: [], 1: [], 2: []}
        for line in stream.splitlines():
            m = re.fullmatch(r"\[default(\d)\]:(rank(\d) .*)", line)
            assert m and m.group(1) == m.group(3), f"bad console line {line!r}"
            seen[int(m.group(1))].append(m.group(2))
        for r in range(3):
            expected = [f"rank{r} {kind} {i}" for i in range(n)] + ([f"rank{r} c-level"] if kind == "out" else [])
            assert seen[r] == expected
            log = (tmp_path / "logs" / str(r) / f"std{kind}.log").read_text().splitlines()
            assert log == expected  # files hold the raw, unprefixed lines


def test_tee_per_rank_mapping(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    procs = make_procs(
        "fork", tmp_path, {0: ("lines", "2"), 1: ("lines", "2")}, redirects={1: Std.ERR}, tee={0: Std.OUT}
    )
    assert run(procs).ok
    captured = capfd.readouterr()
    out, err = captured.out.splitlines(), captured.err.splitlines()
    assert "[default0]:rank0 out 0" in out  # teed
    assert "rank0 err 0" in err  # neither: inherited console
    assert "rank1 out 0" in out  # neither: inherited console
    assert not any("rank1 err" in line for line in err)  # redirected only
    logs = tmp_path / "logs"
    assert (logs / "0" / "stdout.log").exists() and not (logs / "0" / "stderr.log").exists()
    assert (logs / "1" / "stderr.log").exists() and not (logs / "1" / "stdout.log").exists()


@pytest.mark.parametrize("method", METHODS)
def test_no_redirect_inherits_console(method: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert run(make_procs(method, tmp_path, {0: ("ok", "")}, redirects=Std.NONE)).ok
    captured = capfd.readouterr()
    assert "hello stdout rank 0" in captured.out and "hello stderr rank 0" in captured.err
    assert not (tmp_path / "logs" / "0" / "stdout.log").exists()


@pytest.mark.parametrize("method", METHODS)
def test_wait_timeout_names_running_ranks(method: str, tmp_path: Path) -> None:
    ticks = []
    procs = make_procs(method, tmp_path, {0: ("sleep", ""), 1: ("ok", ""), 2: ("sleep", "")})
    with procs:
        procs.start()
        pids = procs.pids
        assert wait_until(lambda: not alive(pids[1]), 10)
        with pytest.raises(RanksTimeoutError, match=r"ranks \[0, 2\] still running") as info:
            procs.wait(0.3, on_tick=lambda: ticks.append(1), tick_s=0.02)
        assert info.value.ranks == [0, 2]
        assert ticks
        assert alive(pids[0]) and alive(pids[2])  # a timeout does not tear down
    assert_reaped(pids)
    result = procs.poll()  # after close: ranks 0 and 2 were stopped, none failed on its own
    assert result is not None and not result.ok and result.failures == {}
    assert result.exitcodes == {0: -signal.SIGTERM, 1: 0, 2: -signal.SIGTERM}


def test_close_is_idempotent_and_kills_grandchildren(tmp_path: Path) -> None:
    gc_file = tmp_path / "grandchild.pid"
    procs = make_procs("spawn", tmp_path, {0: ("grandchild", str(gc_file))}, teardown_timeout_s=1.0)
    procs.start()
    pids = procs.pids
    assert wait_until(gc_file.exists, 10)
    grandchild = int(gc_file.read_text())
    assert alive(grandchild)
    procs.close("test")
    procs.close("again")
    assert_reaped(pids)
    assert wait_until(lambda: not alive(grandchild), 5)


def test_spawn_start_failure_cleans_up(tmp_path: Path) -> None:
    specs = [
        RankSpec(rank=0, env={}, argv=[sys.executable, str(WORKER), "sleep"]),
        RankSpec(rank=1, env={}, argv=[str(tmp_path / "no-such-program")]),
    ]
    procs = RankProcesses(
        specs, start_method="spawn", target=None, log_dir=tmp_path, redirects=Std.ALL, tee=Std.ALL
    )
    with pytest.raises(FileNotFoundError):
        procs.start()
    assert set(procs.pids) == {0}
    assert_reaped(procs.pids)


def test_fork_return_values_and_system_exit(tmp_path: Path) -> None:
    def target(spec: RankSpec) -> int:
        if spec.rank == 0:
            return 0
        raise SystemExit(None)

    specs = [RankSpec(rank=r, env={}) for r in range(2)]
    procs = RankProcesses(
        specs, start_method="fork", target=target, log_dir=tmp_path, redirects=Std.ALL, tee=Std.NONE
    )
    assert run(procs).exitcodes == {0: 0, 1: 0}


def test_argument_validation(tmp_path: Path) -> None:
    kw = dict(log_dir=tmp_path, redirects=Std.NONE, tee=Std.NONE)
    with pytest.raises(ValueError, match="duplicate"):
        RankProcesses([RankSpec(rank=0, env={}), RankSpec(rank=0, env={})], start_method="fork", target=fork_target, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="argv"):
        RankProcesses([RankSpec(rank=0, env={})], start_method="spawn", target=None, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="target"):
        RankProcesses([RankSpec(rank=0, env={})], start_method="fork", target=None, **kw)  # type: ignore[arg-type]
    procs = RankProcesses([RankSpec(rank=0, env={})], start_method="fork", target=fork_target, **kw)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        procs.poll()
    procs.close()  # closing a never-started manager is fine


def test_forked_ranks_drop_launcher_signal_handlers(tmp_path: Path) -> None:
    hits: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: hits.append(signum))
    try:
        procs = make_procs("fork", tmp_path, {0: ("sleep", ""), 1: ("sleep", "")})
        with procs:
            procs.start()
            pids = procs.pids
            time.sleep(0.2)
        assert_reaped(pids)
        result = procs.poll()
        assert result is not None
        assert result.exitcodes == {0: -signal.SIGTERM, 1: -signal.SIGTERM}  # default action, no handler
        assert hits == []  # the launcher itself was never signalled
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_exception_in_on_tick_then_close_on_exit(tmp_path: Path) -> None:
    def on_tick() -> None:
        raise KeyboardInterrupt

    procs = make_procs("spawn", tmp_path, {0: ("sleep", ""), 1: ("sleep", "")}, teardown_timeout_s=1.0)
    with pytest.raises(KeyboardInterrupt), procs:
        procs.start()
        pids = procs.pids
        procs.wait(on_tick=on_tick)
    assert_reaped(pids)


def test_tee_flushes_partial_last_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    def target(spec: RankSpec) -> int:
        print("no newline at end", end="")
        return 0

    procs = RankProcesses(
        [RankSpec(rank=3, env={})], start_method="fork", target=target, log_dir=tmp_path,
        redirects=Std.NONE, tee=Std.OUT,
    )
    assert run(procs).ok
    assert capfd.readouterr().out == "[default3]:no newline at end\n"
    assert (tmp_path / "3" / "stdout.log").read_text() == "no newline at end"
