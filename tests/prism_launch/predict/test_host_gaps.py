"""``replay.host_gaps=removed``: the what-if of a host that keeps up. Each compute span keeps its
shard class's kernel share; classes never profiled stay as measured; the report says which."""

from types import SimpleNamespace

import pyarrow as pa
import pytest

from prism_launch.config import ConfigError, HostGaps, compose, resolve
from prism_launch.config.cluster import load_cluster
from prism_launch.predict import throughput
from prism_launch.predict.prediction import kernel_mixes, remove_host_gaps, scaled_rows
from prism_launch.predict.throughput import Counted, mfu_warning
from prism_launch.report.build import throughput_lines

H100 = load_cluster("h100_ib").gpu
MIXES = [  # a host-bound class (GPU busy 50%) and a device-bound one whose kernels are 20% communication
    {"members": [0, 1], "compute": 0.3, "memory": 0.7, "comm": 0.0, "activity": "cuda kernels", "busy_share": 0.5},
    {"members": [2], "compute": 0.6, "memory": 0.2, "comm": 0.2, "activity": "cuda kernels", "busy_share": 0.72},
]


def _reader(mixes=MIXES):
    return SimpleNamespace(manifest=SimpleNamespace(extra={"kernel_mixes": mixes}))


def _rows():
    return [{"rank": r, "kind": k, "compute_cpu_s": 0.05, "compute_wall_s": 0.1}
            for r in (0, 1, 2, 3) for k in ("compute", "marker")]


def test_each_span_keeps_its_class_kernel_share_and_unprofiled_ranks_stay_as_measured():
    rows = _rows()
    out = remove_host_gaps(rows, _reader())
    wall = {r: [x["compute_wall_s"] for x in rows if x["rank"] == r] for r in (0, 1, 2, 3)}
    assert wall[0] == wall[1] == pytest.approx([0.05, 0.05])     # 50% busy
    assert wall[2] == pytest.approx([0.09, 0.09])                # 72% busy of 80% non-communication: 90% kernels
    assert wall[3] == [0.1, 0.1]                                 # not profiled: as measured
    assert [x["compute_cpu_s"] for x in rows if x["rank"] == 0] == pytest.approx([0.025, 0.025])
    assert out == {"kernel_share": pytest.approx((0.5, 0.9)), "ranks_unchanged": [3]}
    assert remove_host_gaps(_rows(), _reader([])) == {"kernel_share": None, "ranks_unchanged": [0, 1, 2, 3]}


def test_spans_cut_to_their_kernels_are_scaled_by_the_kernels_own_mix():
    whole, kernels = kernel_mixes(_reader())[0], kernel_mixes(_reader(), whole_span=False)[0]
    assert (whole.compute, whole.memory, whole.other) == pytest.approx((0.15, 0.35, 0.5))
    assert (kernels.compute, kernels.memory, kernels.other) == pytest.approx((0.3, 0.7, 0.0))


def _cfg(gaps: str, speedup: float = 1.0):
    return SimpleNamespace(cluster=SimpleNamespace(gpu=H100),
                           replay=SimpleNamespace(host_gaps=HostGaps(gaps), compute_speedup=speedup))


def test_the_replayed_rows_lose_the_host_waits_only_when_asked(monkeypatch):
    monkeypatch.setattr(throughput, "counted", lambda bare: Counted(per_rank={}, embedded_tokens=None, step=2,
                                                                    incomplete=[]))
    device = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}
    reader = SimpleNamespace(manifest=SimpleNamespace(extra={"kernel_mixes": MIXES, "measuring_device": device}),
                             events=lambda: pa.Table.from_pylist(_rows()))
    rows, scaling, _ = scaled_rows(_cfg("measured"), reader, reader, "wall")
    assert "host_gaps_removed" not in scaling
    assert sum(r["compute_wall_s"] for r in rows if r["rank"] == 0) == pytest.approx(0.2)
    rows, scaling, _ = scaled_rows(_cfg("removed", 2.0), reader, reader, "wall")
    # rank 0: 0.1 x 50% kernels, same GPU, then / 2.0; rank 2: 0.1 x 90% kernels less their
    # communication kernels (priced by the network model), / 2.0
    assert sum(r["compute_wall_s"] for r in rows if r["rank"] == 0) == pytest.approx(2 * 0.1 * 0.5 / 2)
    assert sum(r["compute_wall_s"] for r in rows if r["rank"] == 2) == pytest.approx(2 * 0.1 * 0.9 * 0.8 / 2)
    assert sum(r["compute_wall_s"] for r in rows if r["rank"] == 3) == pytest.approx(2 * 0.1 / 2)
    assert scaling["host_gaps_removed"]["ranks_unchanged"] == [3] and scaling["compute_speedup"] == 2.0
    lines = "\n".join(throughput_lines({"throughput": {"tokens_per_step": None, "tokens_source": "x"},
                                        "gpu_scaling": scaling}))
    assert "replay.host_gaps=removed" in lines and "kernel share (50%-90%)" in lines
    assert "1 rank(s) not profiled kept as measured" in lines


def test_the_host_bound_warning_points_to_the_what_if_and_is_dropped_under_it():
    pred = {"cluster_device": "cuda", "cluster": "h100_ib", "compute_source": "calibrated (4 shard classes)",
            "throughput": {"mfu": 0.05}, "gpu_scaling": {"scaled": True, "busy_share": 0.5}}
    assert "replay.host_gaps=removed" in mfu_warning(pred)
    pred["gpu_scaling"]["host_gaps_removed"] = {"kernel_share": (0.5, 0.5), "ranks_unchanged": []}
    assert "host-bound" not in mfu_warning(pred)


def test_the_setting_is_validated_by_its_values():
    assert resolve(compose(["replay.host_gaps=removed"])).replay.host_gaps == HostGaps.removed
    assert resolve(compose([])).replay.host_gaps == HostGaps.measured
    with pytest.raises((ConfigError, ValueError), match="host_gaps"):
        resolve(compose(["replay.host_gaps=dropped"]))


def test_a_host_bound_prediction_carries_the_step_on_a_host_that_keeps_up(monkeypatch):
    """The second replay runs with the host gaps removed and its iteration time is reported with
    the ratio; a device-bound or already host-gap-free prediction gets none."""
    from prism_launch.config import compose, resolve
    from prism_launch.predict import prediction, simulate
    from prism_launch.report.build import prediction_lines

    seen = []

    def fake_rows(cfg, bare, reader, compute):
        seen.append(cfg.replay.host_gaps)
        return [{"compute_wall_s": 0.3}], {}, None

    monkeypatch.setattr(prediction, "scaled_rows", fake_rows)
    monkeypatch.setattr(simulate, "graph_from_events", lambda rows, groups, world, compute: rows)
    monkeypatch.setattr(simulate, "replay", lambda graph, model, **kw: SimpleNamespace(
        iteration_time_s=sum(r["compute_wall_s"] for r in graph)))
    reader = SimpleNamespace(manifest=SimpleNamespace(groups=[], world_size=8))
    cfg = resolve(compose(["cluster=h100_ib"]))
    out = prediction.host_kept_up(cfg, None, reader, "wall", {"busy_share": 0.5}, 0.6)
    assert seen == [HostGaps.removed] and out == {"iteration_time_s": 0.3, "busy_share": 0.5, "speedup": 2.0}
    assert prediction.host_kept_up(cfg, None, reader, "wall", {"busy_share": 0.9}, 0.6) is None  # device-bound
    assert prediction.host_kept_up(cfg, None, reader, "wall", {}, 0.6) is None                   # not profiled
    removed = resolve(compose(["cluster=h100_ib", "replay.host_gaps=removed"]))
    assert prediction.host_kept_up(removed, None, reader, "wall", {"busy_share": 0.5}, 0.6) is None
    pred = {"cluster": "h100_ib", "compute_source": "calibrated", "calibration": None, "iteration_time_s": 0.6,
            "iteration_times_s": [0.6, 0.6], "critical_path": {"ranks": [0], "compute_s": 1.0, "comm_s": 0.1},
            "host_kept_up": out}
    text = "\n".join(prediction_lines(pred))
    assert "host-bound: the GPU was busy 50%" in text and "replay.host_gaps=removed): 300.00 ms" in text
    assert "host-bound" not in "\n".join(prediction_lines({**pred, "host_kept_up": None}))
