"""netbench: argument parsing, fitting of measurements, atomic YAML, bounded waits, and
an end-to-end run with two gloo processes."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from prism_launch.predict.cost_model import ClusterSpec, LinkSpec, NcclCostModel, load_cluster
from prism_launch.predict import netbench

ROOT = Path(__file__).resolve().parents[3]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, "-m", "prism_launch.predict.netbench", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_parse_sizes():
    assert netbench.parse_sizes("16M,1K,4096,1K") == [1024, 4096, 16 << 20]
    assert netbench.parse_size("64KiB") == 65536
    for bad in ("3", "1X", "", "-4"):
        with pytest.raises(Exception):
            netbench.parse_size(bad)
    with pytest.raises(Exception, match="two distinct"):
        netbench.parse_sizes("4K")


def test_fit_measurements_and_table():
    link = LinkSpec(bandwidth_gbps=2.0, latency_us=40.0)
    c = ClusterSpec(
        name="t", gpus_per_node=2, gpu_memory_gib=1.0, intra_node=link, inter_node=link,
        nics_per_node=1, protocol_latency_us=0.0,
    )
    m = NcclCostModel(c)
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 22]
    measured = {}
    for kind in netbench.KINDS:
        for n in sizes:
            measured[(kind, n)] = m.p2p_time(n, 0, 1) if kind == "p2p" else m.collective_time(kind, n, [0, 1])
    fits = netbench.fit_measurements(measured, 2)
    assert set(fits) == {*netbench.KINDS, "all"}
    for fit in fits.values():
        assert fit.bandwidth_gbps == pytest.approx(2.0, rel=1e-6)
        assert fit.latency_us == pytest.approx(40.0, rel=1e-6)
    table = netbench.format_table(measured, link, fits, 2)
    assert len(table.splitlines()) == 1 + len(measured)
    assert "+0.0%" in table


def test_write_atomic_leaves_no_temp(tmp_path: Path):
    out = tmp_path / "sub" / "c.yaml"
    netbench.write_atomic(out, "a: 1\n")
    netbench.write_atomic(out, "a: 2\n")
    assert out.read_text() == "a: 2\n"
    assert [p.name for p in out.parent.iterdir()] == ["c.yaml"]


def test_bad_arguments_exit_nonzero(tmp_path: Path):
    r = _run(["--nproc", "1", "--out", str(tmp_path / "x.yaml")])
    assert r.returncode != 0
    assert "--nproc must be >= 2" in r.stderr
    r = _run(["--sizes", "1K,3", "--out", str(tmp_path / "x.yaml")])
    assert r.returncode != 0 and "multiple of 4" in r.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_timeout_is_reported_and_workers_reaped():
    # Far too short for the workers even to import torch: the wait must end, with an error.
    with pytest.raises(netbench.NetbenchError, match="timed out"):
        netbench.run_workers(2, [1024, 4096], 1, 0, "gloo", 0.3)
    assert multiprocessing.active_children() == []


def test_worker_failure_is_reported():
    with pytest.raises(netbench.NetbenchError, match=r"worker rank \d failed:(.|\n)*Traceback"):
        netbench.run_workers(2, [1024, 4096], 1, 0, "no_such_backend", 60.0)
    assert multiprocessing.active_children() == []


def test_end_to_end_two_processes(tmp_path: Path):
    out = tmp_path / "cluster" / "bench.yaml"
    r = _run(
        # sizes far apart: on a loaded 2-core machine a 1 MiB and a 4 MiB all-reduce can time alike,
        # and the bandwidth fit then (rightly) refuses
        ["--nproc", "2", "--sizes", "4K,4M,32M", "--iters", "5", "--warmup", "1",
         "--name", "bench", "--out", str(out), "--memory-gib", "3", "--timeout", "120"],
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # table: one row per op and size
    rows = [line for line in r.stdout.splitlines() if line.split()[:1] and line.split()[0] in netbench.KINDS]
    assert len(rows) == len(netbench.KINDS) * 3 and {r.split()[0] for r in rows} >= {"reduce_scatter"}
    assert "<- written" in r.stdout
    text = out.read_text()
    assert text.startswith("# Measured by `python -m prism_launch.predict.netbench")
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterSpec), OmegaConf.load(out)))
    assert isinstance(spec, ClusterSpec)
    assert spec.name == "bench" and spec.gpus_per_node == 2 and spec.gpu_memory_gib == 3.0
    assert spec.intra_node.bandwidth_gbps > 0 and spec.intra_node.latency_us >= 0
    assert spec.inter_node == spec.intra_node
    assert spec.protocol_latency_us == 0.0
    assert load_cluster(out) == spec
    assert [p.name for p in out.parent.iterdir()] == ["bench.yaml"]
    # gloo: every collective kind's own fit is written too, and prices that kind
    assert set(spec.kinds) <= {"all_reduce", "all_gather", "reduce_scatter", "broadcast"} and spec.kinds
    model = NcclCostModel(spec)
    for kind, cost in spec.kinds.items():
        assert cost.bandwidth_gbps > 0 and cost.overhead_us == 0.0
        alone = NcclCostModel(dataclasses.replace(spec, kinds={}, intra_node=LinkSpec(
            bandwidth_gbps=cost.bandwidth_gbps, latency_us=cost.latency_us)))
        assert model.collective_time(kind, 1 << 20, [0, 1]) == pytest.approx(alone.collective_time(kind, 1 << 20, [0, 1]))
    assert "kinds: each collective kind's own fit" in text


def test_kind_costs_are_the_collective_kinds_fits():
    fits = {"all_reduce": LinkSpec(bandwidth_gbps=2.345678, latency_us=300.04), "p2p": LinkSpec(bandwidth_gbps=5.0,
            latency_us=50.0), "all": LinkSpec(bandwidth_gbps=3.0, latency_us=100.0)}
    kinds = netbench.kind_costs(fits)
    assert list(kinds) == ["all_reduce"]
    assert (kinds["all_reduce"].bandwidth_gbps, kinds["all_reduce"].latency_us) == (2.346, 300.0)
