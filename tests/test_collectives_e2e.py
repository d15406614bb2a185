"""Every torch.distributed op through capture and emulation of a plain script.

Emulated sandbox ranks must print exactly what they printed in the capture (bit-identical),
and the capture must agree with a real gloo run: bit-exact for pure data movement (broadcast,
gathers, scatter, all-to-all, send/recv), to 1e-5 for reductions (gloo's summation order is its own).
"""

import ast
import json

import pytest

from tests.conftest import WORKERS, rank_lines, rank_log_dirs, run_prism

SCRIPT = WORKERS / "collectives.py"
DATA_MOVEMENT = {"broadcast", "all_gather", "all_gather_into_tensor", "all_to_all_single", "all_to_all", "gather",
                 "scatter", "ring", "send_recv"}
NPROC = 4
COMMON = ["--nproc-per-node", str(NPROC), "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60"]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    d = tmp_path_factory.mktemp("coll")
    r = run_prism([*COMMON, "--log-dir", d / "logs", "mode=capture", f"trace.dir={d / 'trace'}", SCRIPT], cwd=d)
    assert r.returncode == 0, r.stderr
    return d


def _results(lines):
    out = {}
    for line in lines:
        rank, name, vals = line.split(" ", 2)
        out.setdefault(name, []).append(vals)
    return out


def test_capture_matches_real_run(captured, tmp_path):
    r = run_prism([*COMMON, "--log-dir", tmp_path / "logs", "mode=real", SCRIPT], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for rank in range(NPROC):
        real = _results(rank_lines(tmp_path / "logs", rank, f"R{rank} "))
        cap = _results(rank_lines(captured / "logs", rank, f"R{rank} "))
        assert real.keys() == cap.keys()
        assert real["backend"] == cap["backend"] == [f"gloo world {NPROC}"]
        for name in real:
            for a, b in zip(real[name], cap[name], strict=True):
                if name in ("backend", "all_gather_object", "broadcast_object_list", *DATA_MOVEMENT) or b == "'n/a'":
                    assert a == b, name
                    continue
                va, vb = ast.literal_eval(a), ast.literal_eval(b)
                assert len(va) == len(vb), name
                for x, y in zip(va, vb):
                    assert abs(x - y) <= 1e-5 * max(1.0, abs(y)), (name, x, y)


RINGS = ["emulate.pruned_rings=true"]
ORDERED = [*RINGS, "emulate.ring_tags=false"]  # ring messages matched by issue order only (NCCL's rule)
DEVICE = ["emulate.data_path=device"]


@pytest.mark.parametrize(("sandbox", "host", "extra"), [
    ([2], "assistant", []), ([0, 3], "assistant", []), ([1, 2], "assistant", []),
    ([2], "inprocess", []), ([0, 3], "inprocess", []),
    # pruned rings: edges at the seam (0, 3), adjacent live members (1, 2), three live members
    ([0, 3], "assistant", RINGS), ([1, 2], "assistant", RINGS), ([0, 1, 3], "assistant", RINGS),
    ([0, 3], "assistant", ORDERED), ([0, 1, 3], "assistant", ORDERED), ([0, 1, 2, 3], "inprocess", ORDERED),
    # the device data path for ops shared only with virtual ranks, alone and beside rings
    ([2], "assistant", DEVICE), ([1, 2], "assistant", DEVICE + RINGS), ([0, 3], "inprocess", DEVICE),
])
def test_emulation_is_bit_identical_to_capture(captured, tmp_path, sandbox, host, extra):
    r = run_prism([*COMMON, "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={captured / 'trace'}",
                   f"emulate.virtual_host={host}", *extra,
                   f"sandbox.ranks={json.dumps(sandbox)}", f"report.dir={tmp_path / 'report'}", SCRIPT], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for rank in sandbox:
        emu = rank_lines(tmp_path / "logs", rank)
        cap = rank_lines(captured / "logs", rank)
        assert [l for l in emu if l.startswith(f"R{rank} ")] == [l for l in cap if l.startswith(f"R{rank} ")]
        assert len(emu) >= 35
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["world_size"] == NPROC and report["sandbox_ranks"] == sandbox
    for rank in sandbox:
        entry = report["ranks"][str(rank)]
        assert entry["losses_match_capture"] is True
        assert entry["ops"] >= 40
        # object collectives pad with uninitialised bytes; nothing else may diverge, and
        # nothing is within tolerance or a host scalar in a deterministic run
        assert all(d["op"] == "allgather" and d["kind"] == "value" for d in entry["divergences"])
        assert entry["divergence_counts"]["tolerance"] == entry["divergence_counts"]["host_scalar"] == 0
    # only the sandbox ranks ran (plus the assistant, logged under the world size)
    [run_dir] = list((tmp_path / "logs").iterdir())
    assistant = [NPROC] if host == "assistant" else []
    assert rank_log_dirs(run_dir) == sorted(sandbox) + assistant
    if host == "assistant":
        streams = report["assistant"]["streams"]
        assert sorted(map(int, streams)) == sorted(sandbox)
        if not extra:  # rings and the device path take ops off the streams
            assert all(s["messages"] > 10 for s in streams.values())
    if RINGS[0] in extra and host == "assistant":
        assert report["assistant"]["ring_ops"] > 0  # the assistant played edges of pruned rings
        # group reduction: a communicator only for the groups with rings through the assistant
        # (the world group; the odd-rank subgroup's ring is all-sandbox when 1 and 3 are live)
        assert report["assistant"]["ring_groups"] == 1
    if RINGS[0] in extra:
        rings = {r: json.loads((tmp_path / "report" / "sandbox" / f"rank{r}.json").read_text())["ring_groups"]
                 for r in sandbox}
        # the world group, plus each step's own subgroup of even or odd ranks (new_group per
        # step) when both its members are live; never one for a group with one live member
        steps = sum(l.startswith("step ") for l in rank_lines(captured / "logs", sandbox[0]))
        assert steps >= 2
        assert rings == {r: 1 + steps * ({r % 2, r % 2 + 2} <= set(sandbox)) for r in sandbox}, rings
    if DEVICE[0] in extra:
        summary = json.loads((tmp_path / "report" / "sandbox" / f"rank{sandbox[0]}.json").read_text())
        assert summary["prefetch"]["staged_ops"] > 0


def test_virtual_peer_answers_object_collectives_and_backend(captured, tmp_path):
    r = run_prism([*COMMON, "--log-dir", tmp_path / "logs", "mode=emulate", f"trace.dir={captured / 'trace'}",
                   "sandbox.ranks=[3]", "emulate.timing=none", SCRIPT], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = _results(rank_lines(tmp_path / "logs", 3, "R3 "))
    assert lines["backend"] == ["gloo world 4"]
    assert lines["broadcast_object_list"][1] == "[{'step': 1, 'from': 0}]"
    assert ast.literal_eval(lines["all_gather_object"][0]) == [{"rank": r, "s": "x" * r} for r in range(4)]
