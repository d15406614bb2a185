"""A recipe captured without trace.ignore_args, emulated as a new user would: a flag declared
output-only only at emulation takes a new value; a refusal names the flag that differs and
advises declaring it; the order is blamed only when only the order changed."""

import pytest

from tests.conftest import WORKERS, run_prism

HANG = WORKERS / "hang.py"
BASE = ["--nproc-per-node", "2", "-r", "3", "device=cpu", "capture.warm_imports=[torch]"]
RECIPE = ["--out", "run1", "--hidden-size", "64", "--layers", "2"]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    d = tmp_path_factory.mktemp("match")
    r = run_prism([*BASE, "mode=capture", f"trace.dir={d / 'tr'}", HANG, *RECIPE], cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, d / "tr"


def test_a_flag_declared_output_only_at_emulation_takes_a_new_value(captured):
    d, tr = captured
    r = run_prism([*BASE, "trace.ignore_args=[--out]", "mode=emulate", f"trace.dir={tr}", HANG,
                   "--out", "run2", "--hidden-size", "64", "--layers", "2"], cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_refusal_names_the_flag_and_the_advice_declares_it(captured):
    d, tr = captured
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={tr}", HANG, "--out", "run2", "--hidden-size", "64",
                   "--layers", "2"], cwd=d)
    assert r.returncode == 1
    assert "script args differ: --out: recorded run1, now run2" in r.stderr, r.stderr[-2000:]
    assert "trace.ignore_args=[--out]" in r.stderr
    assert "(order)" not in r.stderr and "ignore_args=[]" not in r.stderr


def test_the_order_is_named_only_when_it_moved(captured):
    d, tr = captured
    r = run_prism([*BASE, "mode=emulate", f"trace.dir={tr}", HANG, "--hidden-size", "64", "--out", "run1",
                   "--layers", "2"], cwd=d)
    assert r.returncode == 1
    assert "script args differ in order only" in r.stderr, r.stderr[-2000:]


def test_without_trace_dir_the_refusal_points_at_the_trace_beside_it(tmp_path):
    """The default folder's name keys the arguments: declaring --out output-only only at
    emulation names another folder, and the refusal shows the capture's beside it."""
    r = run_prism([*BASE, "mode=capture", HANG, *RECIPE], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    [captured] = [p for p in (tmp_path / "prism_traces").iterdir() if p.is_dir()]
    r = run_prism([*BASE, "trace.ignore_args=[--out]", "mode=emulate", HANG, "--out", "run2", "--hidden-size", "64",
                   "--layers", "2"], cwd=tmp_path)
    assert r.returncode == 1
    assert captured.name in r.stderr and "trace.dir=<it>" in r.stderr, r.stderr[-2000:]
    r = run_prism([*BASE, "trace.ignore_args=[--out]", "mode=emulate", f"trace.dir={captured}", HANG,
                   "--out", "run2", "--hidden-size", "64", "--layers", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
