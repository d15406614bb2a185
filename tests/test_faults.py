"""Faults around a run: the launcher signalled, a rank killed, a full disk, two runs on one
trace, an unwritable trace directory. Each ends with a plain message that names what is wrong
and what to do, a non-zero exit, no process left and nothing that emulation would accept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, WORKERS, _env, run_prism

pytestmark = pytest.mark.serial  # wall-clock bounds: run alone (make test)

HANG = WORKERS / "hang.py"
BASE = ["--nproc-per-node", "2", "-r", "3", "device=cpu", "capture.warm_imports=[torch]"]


# -- helpers ----------------------------------------------------------------------------------------------


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_prism(args: list, *, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "prism_launch", *[str(a) for a in args]]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def wait_for_ranks(proc: subprocess.Popen, pid_dir: Path, ranks: list[int], timeout_s: float = 60) -> dict[int, int]:
    """Pids of ``ranks`` once each has written its pid file (hang.py's PID_DIR)."""
    files = [pid_dir / f"rank{r}.pid" for r in ranks]

    def ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        return all(f.exists() and f.read_text() for f in files)

    wait_for(ready, timeout_s, f"ranks {ranks} to start")
    time.sleep(0.5)  # past step 0: the hanging rank sleeps, its peers wait on it
    return {r: int(f.read_text()) for r, f in zip(ranks, files)}


def assert_no_trace(path: Path) -> None:
    from prism_launch.trace import TraceMissingError, TraceReader

    with pytest.raises(TraceMissingError):
        TraceReader(path)
    assert not [p for p in path.parent.iterdir() if ".partial" in p.name], list(path.parent.iterdir())


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    r = run_prism([*BASE, "mode=capture", f"trace.dir={d / 'tr'}", HANG], cwd=d)
    assert r.returncode == 0, r.stderr
    return d / "tr"


# -- the launcher signalled -------------------------------------------------------------------------------


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_to_launcher_during_capture(tmp, short_tmp, sig, code):
    pids, temp = tmp / "pids", short_tmp  # the launcher's temporary directory: where its coordinator's socket lives
    pids.mkdir()
    proc = start_prism([*BASE, "mode=capture", f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp,
                       env={"HANG_RANK": "1", "PID_DIR": str(pids), "TMPDIR": str(temp)})
    wait_for_ranks(proc, pids, [0, 1])
    kids = descendants(proc.pid)
    assert len(kids) >= 2
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err[-3000:]
    assert time.monotonic() - t0 < 15
    assert f"interrupted (received {sig.name})" in err and "all ranks stopped" in err
    assert "Traceback" not in err
    assert not [p for p in kids if alive(p)]
    assert_no_trace(tmp / "tr")
    assert list(temp.glob("prism-coord-*")) == []  # the coordinator's socket and its folder are gone


def test_a_second_signal_does_not_cut_the_teardown_short(tmp):
    """SIGHUP, then SIGTERM and SIGHUP again and again until the launcher has exited: it still
    exits 129 (the first signal's code) after stopping every rank, and leaves no trace,
    half-written or not."""
    pids = tmp / "pids"
    pids.mkdir()
    proc = start_prism([*BASE, "mode=capture", f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp,
                       env={"HANG_RANK": "1", "PID_DIR": str(pids)})
    wait_for_ranks(proc, pids, [0, 1])
    kids = descendants(proc.pid)
    proc.send_signal(signal.SIGHUP)
    # repeats every 2 ms while ranks are stopped, while the trace is removed and while the
    # launcher exits (a few tenths of a second), so one lands between every layer's handlers
    repeats, deadline = 0, time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
        try:
            proc.send_signal((signal.SIGTERM, signal.SIGHUP)[repeats % 2])
        except ProcessLookupError:
            break
        repeats += 1
    _, err = proc.communicate(timeout=30)
    assert repeats >= 3
    assert proc.returncode == 129, err[-3000:]
    assert "interrupted (received SIGHUP)" in err and "all ranks stopped" in err
    assert "Traceback" not in err
    assert not [p for p in kids if alive(p)]
    assert_no_trace(tmp / "tr")
    leftovers = list((tmp / "tr").rglob("*")) if (tmp / "tr").exists() else []
    assert leftovers == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_during_emulation(trace, tmp, sig, code):
    pids = tmp / "pids"
    pids.mkdir()
    proc = start_prism([*BASE, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[1]",
                        f"report.dir={tmp / 'rep'}", HANG], cwd=tmp, env={"HANG_RANK": "1", "PID_DIR": str(pids)})
    wait_for_ranks(proc, pids, [1])
    kids = descendants(proc.pid)
    assert len(kids) >= 2  # the sandbox rank and the assistant
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err[-3000:]
    assert time.monotonic() - t0 < 15
    assert f"interrupted (received {sig.name})" in err and "Traceback" not in err
    assert not [p for p in kids if alive(p)]
    assert not (tmp / "rep" / "report.json").exists()


# -- a rank killed ----------------------------------------------------------------------------------------


def test_rank_killed_mid_capture_is_named_with_its_signal(tmp):
    pids = tmp / "pids"
    pids.mkdir()
    proc = start_prism([*BASE, "mode=capture", f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp,
                       env={"HANG_RANK": "1", "PID_DIR": str(pids)})
    ranks = wait_for_ranks(proc, pids, [0, 1])
    kids = descendants(proc.pid)
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err[-3000:]
    assert "rank 1 failed (signal SIGKILL)" in err and "killed by SIGKILL" in err, err[-3000:]
    assert "Traceback" not in err.split("prism-launch: error:")[1]
    assert not [p for p in kids if alive(p)]
    assert_no_trace(tmp / "tr")


def test_rank_killed_mid_emulation_is_named_with_its_signal(trace, tmp):
    pids = tmp / "pids"
    pids.mkdir()
    proc = start_prism([*BASE, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[1]",
                        f"report.dir={tmp / 'rep'}", HANG], cwd=tmp, env={"HANG_RANK": "1", "PID_DIR": str(pids)})
    ranks = wait_for_ranks(proc, pids, [1])
    kids = descendants(proc.pid)
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err[-3000:]
    assert "rank 1 failed (signal SIGKILL)" in err and "killed by SIGKILL" in err, err[-3000:]
    assert not [p for p in kids if alive(p)]


# -- a full disk ------------------------------------------------------------------------------------------

FAKE_DISK = WORKERS / "fake_disk"


def test_full_disk_before_capture_starts_no_rank(tmp):
    r = run_prism([*BASE, "--log-dir", tmp / "logs", f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp,
                  env={"PYTHONPATH": str(FAKE_DISK), "PRISM_FAKE_FREE_BYTES": "1000"}, timeout=60)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"not enough free disk space for the PrismTrace at {tmp}" in r.stderr
    assert "1000 B free there" in r.stderr and "trace.dir=" in r.stderr
    assert "Traceback" not in r.stderr and "No PrismTrace" not in r.stderr
    assert not (tmp / "logs").exists() or not list((tmp / "logs").iterdir())  # no rank started
    assert_no_trace(tmp / "tr")


def test_full_disk_at_the_writer_in_auto_mode_is_plain(tmp):
    """Room for the launcher's floor, not for the trace: the capture starts, its free-space
    check refuses the next spill file before writing it; auto mode says so plainly and
    emulates nothing."""
    from prism_launch.trace.space import SLACK_BYTES

    r = run_prism([*BASE, f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp, timeout=120,
                  env={"PYTHONPATH": str(FAKE_DISK), "PRISM_FAKE_FREE_BYTES": str(SLACK_BYTES + 100)})
    assert r.returncode == 1, r.stderr[-3000:]
    err = r.stderr.split("prism-launch: error:", 1)[1]
    # exact tensors stream to disk: the capture's own check finds that the next spill file
    # (capture.spill_mib) would not fit, before writing it
    assert "not enough free" in err and "needs about" in err and "free there" in err, err
    assert "Nothing was written that emulation would accept" in err
    assert "Traceback" not in r.stderr and "No PrismTrace" not in r.stderr
    assert_no_trace(tmp / "tr")


# -- two runs on one trace --------------------------------------------------------------------------------


def test_two_emulations_of_one_trace_at_once(trace, tmp):
    """The second run on the same report directory is refused naming the first; the first
    completes; with its own report.dir, a run beside it completes too."""
    pids = tmp / "pids"
    pids.mkdir()
    first = start_prism([*BASE, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[1]", HANG], cwd=tmp,
                        env={"PID_DIR": str(pids), "HANG_RANK": "1", "STEPS": "2"})
    wait_for_ranks(first, pids, [1])
    second = run_prism([*BASE, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[0]", HANG], cwd=tmp, timeout=60)
    beside = run_prism([*BASE, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[0]", f"report.dir={tmp / 'r2'}",
                        HANG], cwd=tmp, timeout=60)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=30)
    assert second.returncode == 1, second.stderr[-3000:]
    assert f"{trace / 'report'} is in use by another prism-launch (pid {first.pid} on host " in second.stderr
    assert "started 20" in second.stderr and "report.dir=" in second.stderr
    assert beside.returncode == 0, beside.stderr[-3000:]
    assert (tmp / "r2" / "report.json").exists()
    assert first.returncode == 143, err[-3000:]


def test_a_second_capture_on_a_trace_is_told_who_holds_it(tmp):
    """While a capture writes a trace, a second capture on the same trace.dir is refused at once,
    naming the first (its pid and host) and the setting to change; the first is undisturbed."""
    pids = tmp / "pids"
    pids.mkdir()
    first = start_prism([*BASE, "mode=capture", f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp,
                        env={"HANG_RANK": "1", "PID_DIR": str(pids)})
    try:
        wait_for_ranks(first, pids, [0, 1])
        t0 = time.monotonic()
        second = run_prism([*BASE, "mode=capture", f"trace.dir={tmp / 'tr'}", HANG], cwd=tmp, timeout=60)
        assert second.returncode == 1, second.stderr[-3000:]
        assert time.monotonic() - t0 < 30
        assert str(tmp / "tr") in second.stderr and f"pid {first.pid} on host " in second.stderr
        assert "trace.dir=" in second.stderr and "Traceback" not in second.stderr
        assert first.poll() is None  # the holder runs on
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=30)
    assert first.returncode == 143, err[-3000:]


def test_lock_names_its_holder_and_goes_with_it(tmp):
    from prism_launch.trace import TraceBusyError
    from prism_launch.trace.lock import DirLock

    with DirLock(tmp / "rep", setting="report.dir"):
        with pytest.raises(TraceBusyError, match=rf"pid {os.getpid()} on host .*report.dir="):
            DirLock(tmp / "rep", setting="report.dir").acquire()
    DirLock(tmp / "rep", setting="report.dir").acquire().release()  # released with its holder


# -- a trace directory that cannot be written -------------------------------------------------------------


def _as_user(args: list) -> list:
    """Root writes through 0o500 (CAP_DAC_OVERRIDE): run ``args`` without the capabilities that
    bypass permission bits (setpriv), so the bits count. The process stays root, so an interpreter
    that only root can reach (pyenv's under a 0o700 /root) still starts."""
    if os.geteuid() != 0:
        return args
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", *args]


def test_unwritable_trace_directory_is_refused_before_any_rank(tmp_path_factory):
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="prism-ro-"))
    try:
        d.chmod(0o755)
        parent = d / "ro"
        parent.mkdir()
        parent.chmod(0o500)  # read-only to its owner, this test's user
        cmd = _as_user([sys.executable, "-m", "prism_launch", *BASE, "mode=capture", f"trace.dir={parent / 'tr'}",
                        str(HANG)])
        env = _env({"HOME": str(d)})
        r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr[-3000:]
        assert f"cannot write {parent / 'tr'}: {parent} is not writable (Permission denied)" in r.stderr
        assert "trace.dir=" in r.stderr and f"chmod u+w {parent}" in r.stderr and "no rank was started" in r.stderr
        assert "Traceback" not in r.stderr and "[default0]" not in r.stderr
        assert not (parent / "tr").exists()
    finally:
        import shutil

        (d / "ro").chmod(0o700)
        shutil.rmtree(d, ignore_errors=True)


# -- a failing program in the default mode ----------------------------------------------------------------


def test_auto_mode_shows_the_rank_error_first_and_no_launcher_traceback(tmp):
    script = tmp / "broken.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\nimport no_such_module_x\n")
    r = run_prism([*BASE, f"trace.dir={tmp / 'tr'}", script], cwd=tmp, timeout=60)
    assert r.returncode == 1
    err = r.stderr.split("prism-launch: error:", 1)[1]
    assert err.lstrip().startswith("rank ") and "ModuleNotFoundError: No module named 'no_such_module_x'" in err
    assert "No PrismTrace" not in r.stderr and "During handling" not in r.stderr
    assert "rank_start.py" not in err and "runpy" not in err  # the program's frames only
    assert "mode=auto: the capture failed, so no trace was written" in err
    r = run_prism([*BASE, f"trace.dir={tmp / 'tr'}", script], cwd=tmp, timeout=60, env={"PRISM_DEBUG": "1"})
    assert r.returncode == 1 and "prism_launch/cli/__init__.py" in r.stderr  # the launcher's traceback, asked for
