"""A captured rank out of GPU memory: the launcher's error says how many ranks were on the device
and which settings put fewer there."""

from types import SimpleNamespace

from prism_launch.capture.slots import MemoryAdmission
from prism_launch.errors import RunFailedError
from prism_launch.modes.capture import out_of_memory

OOM = ("rank 505 failed (exitcode 1): AcceleratorError: CUDA error: out of memory\n"
       "per-rank logs: /tmp/x")


def _ctx(on_cuda: bool = True):
    return SimpleNamespace(cfg=SimpleNamespace(on_cuda=on_cuda))


def _admission() -> MemoryAdmission:
    adm = MemoryAdmission([50 << 30], lambda r: 0)
    adm.report(0, {"peak_reserved_bytes": 20 << 30})
    assert adm.admit(0) and adm.admit(1)
    assert not adm.admit(2)
    assert adm.admit(2, force=True)  # every rank on the device waited on a peer
    return adm


def test_oom_names_ranks_forced_and_settings():
    err = out_of_memory(RunFailedError(OOM), _ctx(), list(range(16)), _admission(), park=None)
    text = str(err)
    assert text.startswith(OOM)
    assert "16 rank(s) are captured" in text
    assert "up to 3 were on the device at once, 1 of them started past the GPU's free memory" in text
    assert "capture.ep_sample=1" in text and "capture.park=cuda_checkpoint capture.resident=K" in text


def test_oom_with_parking_names_resident_only():
    err = out_of_memory(RunFailedError(OOM), _ctx(), [0, 1, 2], None, park=object())
    text = str(err)
    assert "capture.park=" not in text and "capture.resident=K" in text
    assert "at once" not in text  # no admission: nothing measured to say


def test_other_failures_and_cpu_unchanged():
    other = RunFailedError("rank 3 failed (exitcode 1): ValueError: bad flag")
    assert out_of_memory(other, _ctx(), [0], _admission(), None) is other
    oom = RunFailedError(OOM)
    assert out_of_memory(oom, _ctx(on_cuda=False), [0], None, None) is oom


def test_one_rank_alone_is_told_the_card_is_too_small():
    err = str(out_of_memory(RunFailedError(OOM), _ctx(), [0], None, park=None))
    assert "one rank of this job does not fit this GPU" in err and "capture.ep_sample" not in err
    adm = MemoryAdmission([50 << 30], lambda r: 0)
    assert adm.admit(0)  # the probe ran alone and ran out of memory
    err = str(out_of_memory(RunFailedError(OOM), _ctx(), [0, 1], adm, park=None))
    assert "one rank of this job does not fit this GPU" in err


def test_capture_and_emulation_read_an_out_of_memory_failure_alike(tmp_path):
    """One predicate for both modes: a sandbox rank whose kernel launch failed with CUDA's
    out-of-memory error is a finding of emulation too, not only torch's OutOfMemoryError."""
    import json

    from prism_launch.errors import reads_out_of_memory
    from prism_launch.modes.emulate import sandbox_oom
    from prism_launch.trace import RankLogs

    for text in ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                 "RuntimeError: CUDA error: out of memory"):
        assert reads_out_of_memory(text)
    assert not reads_out_of_memory("RuntimeError: CUDA error: an illegal memory access was encountered")
    path = RankLogs(tmp_path).error_file(3)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"message": {"message": "RuntimeError: CUDA error: out of memory\nmore"}}))
    assert sandbox_oom(tmp_path, [3]) == {"rank": 3, "message": "rank 3: RuntimeError: CUDA error: out of memory"}
    assert sandbox_oom(tmp_path, [4]) is None
