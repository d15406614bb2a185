"""A trace is code: emulation unpickles its recorded object-collective payloads. A trace its user
signed replays as it is; an unsigned one whose payload was replaced by a pickle that calls
os.system is refused by name in the sandbox rank, before it runs; ``trace.trusted=true`` lifts
the restriction (and the same payload then does run: the premise of the refusal)."""

import json
import os
import pickle
import shutil
import struct

from prism_launch.trace.checksums import sha256_file
from prism_launch.trace.signing import SIGNATURE_NAME
from tests.conftest import WORKERS, rank_lines, run_prism


class _System:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _replace_payload(trace):
    """Overwrite the recorded pickle of the broadcast in place (same length) and reseal the
    file's sum in the manifest, as a hostile author of the trace would."""
    manifest = json.loads((trace / "manifest.json").read_text())
    [rel] = [r for r in manifest["files"] if r.startswith("tensors/blob")]
    data = bytearray((trace / rel).read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    [(begin, end)] = [v["data_offsets"] for k, v in json.loads(data[8:8 + n]).items()
                      if k != "__metadata__" and v["dtype"] == "U8"]  # the broadcast object's pickle
    start, end = 8 + n + begin, 8 + n + end
    assert bytes(data[start:start + 2]) == b"\x80\x04"
    evil = pickle.dumps(_System(), protocol=4)
    assert len(evil) <= end - start
    data[start:end] = evil + b"\0" * (end - start - len(evil))  # the unpickler stops at evil's STOP
    (trace / rel).write_bytes(bytes(data))
    manifest["files"][rel] = sha256_file(trace / rel)
    (trace / "manifest.json").write_text(json.dumps(manifest))
    (trace / SIGNATURE_NAME).unlink()


def test_an_unsigned_trace_cannot_run_code_through_an_object_payload(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    script = WORKERS / "broadcast_object.py"
    common = ["--nproc-per-node", "2", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60",
              "sandbox.ranks=[1]", f"trace.dir={tmp_path / 't'}"]
    cap = run_prism([*common, "--log-dir", tmp_path / "cap", "mode=capture", script], cwd=tmp_path, env=env)
    assert cap.returncode == 0, cap.stderr[-3000:]
    [line] = rank_lines(tmp_path / "cap", 1, "R1 ")
    assert "'lr': 0.25" in line and "torch.Size([2, 3])" in line

    signed = run_prism([*common, "--log-dir", tmp_path / "signed", "mode=emulate", script], cwd=tmp_path, env=env)
    assert signed.returncode == 0, signed.stderr[-3000:]
    assert rank_lines(tmp_path / "signed", 1, "R1 ") == [line]
    assert "allow-list" not in signed.stderr and "not signed" not in signed.stderr

    _replace_payload(tmp_path / "t")
    refused = run_prism([*common, "--log-dir", tmp_path / "refused", "mode=emulate", script], cwd=tmp_path, env=env)
    assert refused.returncode != 0
    assert "is not signed: its object-collective payloads are unpickled through an allow-list" in refused.stderr
    assert "RestrictedPayloadError" in refused.stderr and "names posix.system" in refused.stderr
    assert "trace.trusted=true" in refused.stderr
    assert not (tmp_path / "pwned").exists()

    trusted = run_prism([*common, "--log-dir", tmp_path / "trusted", "mode=emulate", "trace.trusted=true", script],
                        cwd=tmp_path, env=env)
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    assert "allow-list" not in trusted.stderr
    assert (tmp_path / "pwned").exists()  # trusted: the payload is unpickled as it is
    assert rank_lines(tmp_path / "trusted", 1, "R1 ") == ["R1 got 0"]


def test_real_object_payloads_pass_the_allow_list(tmp_path):
    """torch.distributed.checkpoint's save (plans scattered from rank 0: its dataclasses, enums,
    torch.Size, layouts, paths) emulates from an unsigned trace: the allow-list covers real
    payloads, not only toy ones."""
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    script = WORKERS / "dcp_save.py"
    common = ["--nproc-per-node", "8", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60",
              "capture.fold=true", f"trace.dir={tmp_path / 't'}"]
    cap = run_prism([*common, "sandbox.ranks=[0,3]", "--log-dir", tmp_path / "cap", "mode=capture", script],
                    cwd=tmp_path, env=env)
    assert cap.returncode == 0, cap.stderr[-3000:]
    (tmp_path / "t" / SIGNATURE_NAME).unlink()
    shutil.rmtree(tmp_path / "ckpt")
    emu = run_prism([*common, "sandbox.ranks=[3]", "--log-dir", tmp_path / "emu", "mode=emulate", script],
                    cwd=tmp_path, env=env)
    assert emu.returncode == 0, emu.stderr[-3000:]
    assert "is not signed: its object-collective payloads are unpickled through an allow-list" in emu.stderr
    assert (tmp_path / "ckpt" / "__3_0.distcp").is_file()
