"""Faults and attacks on prism-launch, driven from outside as a user or an attacker would.

Each case runs ``python -m prism_launch`` of the checkout under test (``--repo``, default this
one) on the CPU with small worlds and prints one line: ``PASS``/``FAIL`` ``(x) what was
checked: what was seen``. Exits non-zero when any case fails.

(a) a ``.so`` planted in the predictable fallback cache folder of the CPU allocator hook
    (world-writable) is not loaded: its constructor never runs, and the run says the folder is
    refused (or builds the hook in a private folder);
(b) a trace whose object-collective payload was replaced by a malicious pickle (its checksums
    rewritten, as an attacker would) is refused by the emulation, and accepted with
    ``trace.trusted=true``;
(c) a raw connection opened and closed on the capture coordinator's socket mid-capture does
    not stop the capture;
(d) a launcher SIGKILLed while it spills tensors leaves a staging folder that the next capture
    of the trace removes;
(e) a capture started while an emulation of the same trace runs (or the other way round) is
    refused naming the holder, or waits;
(f) no socket of a single-node emulation's processes (two sandbox ranks) listens beyond
    loopback.

    .venv/bin/python bench/security_faults.py [--repo PATH] [--only a,c] [--keep]

Runs only on this machine's loopback; each case has its own timeout.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
WORKER = "tests/workers/collectives.py"
FLAGS = ["--nproc-per-node", "4", "-r", "3", "device=cpu", "capture.warm_imports=[torch]", "comm.timeout_s=60"]


@dataclass
class Result:
    case: str
    ok: bool
    what: str
    seen: str


class Bench:
    def __init__(self, repo: Path, work: Path) -> None:
        self.repo, self.work = repo, work
        self.tmp = work / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._trace: Path | None = None

    # -- running prism-launch -------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(self.repo)
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONWARNINGS"] = "ignore"
        env["TMPDIR"] = str(self.tmp)  # the run's temporary folders (coordinator socket, caches) stay here
        env.update(extra)
        return env

    def cmd(self, *args: str | Path) -> list[str]:
        return [sys.executable, "-m", "prism_launch", *map(str, args)]

    def start(self, *args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.cmd(*args), cwd=cwd or self.work, env=env or self.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def run(self, *args: str | Path, timeout: float = 300, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        p = self.start(*args, env=env, cwd=cwd)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(p)
            out, err = p.communicate()
            err += f"\n[bench: timed out after {timeout:g}s]"
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def worker(self) -> str:
        return str(self.repo / WORKER)

    def capture(self, trace: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.run(*FLAGS, "--log-dir", self.work / "logs" / trace.name, "mode=capture", f"trace.dir={trace}",
                        *extra, self.worker(), timeout=timeout)

    def trace(self) -> Path:
        """A captured trace of the collectives worker, shared by the cases that only read it."""
        if self._trace is None:
            t = self.work / "shared-trace"
            r = self.capture(t)
            if r.returncode != 0:
                raise RuntimeError(f"capturing the shared trace failed: {tail(r.stderr)}")
            self._trace = t
        return self._trace

    def copy_trace(self, name: str) -> Path:
        dst = self.work / name
        shutil.copytree(self.trace(), dst, symlinks=True)
        return dst


def tail(text: str, n: int = 300) -> str:
    text = " ".join((text or "").split())
    return text[-n:]


def kill_tree(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


# ----------------------------------------------------------------------------- (a)


HOOK_SO = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("planted constructor ran\n", f); fclose(f); }
}
"""


def hook_key(repo: Path) -> str:
    """The cache key the checkout's hook build uses (source, torch, compiler, ABI)."""
    import torch

    cxx = next(shutil.which(c) for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c))
    source = (repo / "prism_launch" / "rank" / "cpu_alloc_hook.cpp").read_bytes()
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    torch_dir = Path(torch.__file__).resolve().parent
    return hashlib.sha256("\0".join((hashlib.sha256(source).hexdigest(), torch.__version__, str(torch_dir), cxx,
                                     str(abi))).encode()).hexdigest()[:16]


def case_a(b: Bench) -> Result:
    what = "(a) a .so planted in the world-writable fallback cache folder is not loaded"
    marker = b.work / "a-planted-ran"
    fallback = b.tmp / f"prism_launch-{os.getuid()}" / "cpu_alloc_hook"
    fallback.mkdir(parents=True, exist_ok=True)
    for d in (fallback.parent, fallback):
        os.chmod(d, 0o777)  # what a folder another user made in /tmp looks like
    src = b.work / "planted.c"
    src.write_text(HOOK_SO % marker)
    target = fallback / f"prism_cpu_alloc_{hook_key(b.repo)}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(target), str(src)], check=True)
    os.chmod(target, 0o777)
    # the configured root cannot be made, so the predictable fallback under TMPDIR is chosen
    env = b.env(XDG_CACHE_HOME="/proc/self/no-such-dir", HOME="/proc/self/no-such-home")
    logs = b.work / "logs" / "a"
    r = b.run("--nproc-per-node", "1", "device=cpu", "--log-dir", logs, "mode=real", "memory.track=true",
              "memory.cpu_hook=true", b.worker(), env=env, timeout=240)
    said = r.stdout + r.stderr
    for f in logs.rglob("*") if logs.exists() else ():
        if f.is_file():
            said += f.read_text(errors="replace")
    ran = marker.exists()
    refused = str(fallback.parent) in said and bool(re.search(r"refus|only you can write|writable by", said))
    private = [p for p in b.tmp.rglob("prism_cpu_alloc_*.so") if p != target and not (p.stat().st_mode & 0o022)]
    ok = not ran and (refused or bool(private))
    seen = (f"constructor {'RAN' if ran else 'did not run'}; run rc={r.returncode}; "
            + ("refused the folder" if refused else f"built privately at {private[0]}" if private
               else "no word of the folder") + ("" if ok else f"; {tail(r.stderr)}"))
    return Result("a", ok, what, seen)


# ----------------------------------------------------------------------------- (b)


def _evil(marker: Path, length: int) -> bytes:
    """A pickle that runs ``touch <marker>`` when loaded, padded to ``length`` bytes (a pickle
    ends at its STOP opcode; torch's unpickler never reads the padding)."""
    rel = os.path.relpath(marker, marker.parent)
    payload = f"cposix\nsystem\n(S'touch {rel}'\ntR.".encode()
    if len(payload) > length:
        raise ValueError(f"the recorded payload ({length} bytes) is too short for the malicious pickle")
    return payload + b"\0" * (length - len(payload))


def poison(trace: Path, marker: Path) -> int:
    """Replace every recorded pickle of the worker's broadcast_object_list with a malicious one,
    and rewrite the manifest's checksums so nothing but authorship can tell. Returns the count."""
    originals = [pickle.dumps({"step": s, "from": 0}) for s in range(4)]
    manifest = json.loads((trace / "manifest.json").read_text())
    hits = 0
    for rel in list(manifest["files"]):
        path = trace / rel
        data = path.read_bytes()
        new = data
        for o in originals:
            new = new.replace(o, _evil(marker, len(o)))
        if new != data:
            hits += sum(data.count(o) for o in originals)
            path.write_bytes(new)
            manifest["files"][rel] = hashlib.sha256(new).hexdigest()
    (trace / "manifest.json").write_text(json.dumps(manifest))
    for stale in trace.glob(".verified*"):
        stale.unlink()
    return hits


def case_b(b: Bench) -> Result:
    what = "(b) a trace whose object payload is a malicious pickle is refused, and accepted with trace.trusted=true"
    trace = b.copy_trace("b-trace")
    marker = b.work / "bP"  # short: the command must fit in the recorded pickle (34 bytes)
    n = poison(trace, marker)
    if n == 0:
        return Result("b", False, what, "found no recorded object payload to replace")
    common = [*FLAGS, "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[1]"]
    r1 = b.run("--log-dir", b.work / "logs" / "b1", *common, f"report.dir={b.work / 'b-r1'}", b.worker(), timeout=240)
    ran1 = marker.exists()
    marker.unlink(missing_ok=True)
    r2 = b.run("--log-dir", b.work / "logs" / "b2", *common, f"report.dir={b.work / 'b-r2'}", "trace.trusted=true",
               b.worker(), timeout=240)
    ran2 = marker.exists()
    refused = not ran1 and r1.returncode != 0 and bool(re.search(r"RestrictedPayload|may not load|refus", r1.stderr))
    ok = refused and ran2
    seen = (f"{n} payloads replaced; untrusted: rc={r1.returncode}, pickle {'RAN' if ran1 else 'not run'}"
            f"{', refused by name' if refused else ''}; trusted: rc={r2.returncode}, pickle "
            f"{'ran (accepted)' if ran2 else 'not run'}" + ("" if ok else f"; {tail(r1.stderr if not refused else r2.stderr)}"))
    return Result("b", ok, what, seen)


# ----------------------------------------------------------------------------- (c)


def _coordinator_socket(b: Bench, since: float) -> Path | None:
    for plan in (b.work / "logs").rglob("plan.json"):
        try:
            address = json.loads(plan.read_text()).get("capture", {}).get("coordinator")
        except (OSError, ValueError, AttributeError):
            continue
        if address and os.path.exists(address) and plan.stat().st_mtime >= since:
            return Path(address)
    found = [Path(p) for p in glob.glob(str(b.tmp / "prism-coord-*" / "coord.sock"))]
    found = [p for p in found if p.stat().st_mtime >= since]
    return found[0] if found else None


def case_c(b: Bench) -> Result:
    import socket

    what = "(c) a raw connection opened and closed on the coordinator's socket mid-capture does not stop it"
    trace = b.work / "c-trace"
    t0 = time.time() - 1
    p = b.start(*FLAGS, "--log-dir", b.work / "logs" / "c", "mode=capture", f"trace.dir={trace}", b.worker())
    poked, sock_path = 0, None
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline and poked < 3:
        sock_path = sock_path or _coordinator_socket(b, t0)
        if sock_path is not None:
            for payload in (b"", b"\x00\x00\x00\x04junk"):
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.settimeout(2)
                        s.connect(str(sock_path))
                        if payload:
                            s.sendall(payload)
                    poked += 1
                except OSError:
                    pass
        time.sleep(0.1)
    try:  # the capture alone takes ~10 s here; one the connection stalled never ends by itself
        out, err = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        out, err = p.communicate()
        err += "[bench: timed out after 150 s]"
    ok = poked > 0 and p.returncode == 0 and (trace / "manifest.json").exists()
    seen = (f"{poked} raw connections to {sock_path}; capture rc={p.returncode}"
            + ("" if ok else f"; {tail(err)}"))
    return Result("c", ok, what, seen)


# ----------------------------------------------------------------------------- (d)


def case_d(b: Bench) -> Result:
    what = "(d) a launcher SIGKILLed mid-spill leaves a staging folder the next capture removes"
    trace = b.work / "d-trace"
    p = b.start(*FLAGS, "--log-dir", b.work / "logs" / "d1", "mode=capture", f"trace.dir={trace}",
                "capture.spill_mib=0.0001", b.worker())
    staged: list[Path] = []
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline:
        staged = [s for s in trace.parent.glob(f".{trace.name}.partial-*") if any(s.rglob("*"))]
        if staged:
            break
        time.sleep(0.05)
    if not staged:
        kill_tree(p)
        p.communicate()
        return Result("d", False, what, f"no staging folder with spilled files appeared (launcher rc={p.returncode})")
    os.kill(p.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer would
    p.communicate()
    time.sleep(1.0)  # its ranks follow it (parent-death signal)
    kill_tree(p)
    left = [s for s in staged if s.exists()]
    r = b.capture(trace)
    still = [s.name for s in left if s.exists()]
    ok = bool(left) and r.returncode == 0 and not still
    seen = (f"killed pid {p.pid} with {len(left)} staging folder(s) left; next capture rc={r.returncode}; "
            + (f"still there: {still}" if still else "removed") + ("" if ok else f"; {tail(r.stderr)}"))
    return Result("d", ok, what, seen)


# ----------------------------------------------------------------------------- (e)


def case_e(b: Bench) -> Result:
    what = "(e) a capture and an emulation of one trace at once: one waits or is refused by name"
    trace = b.copy_trace("e-trace")
    cap = b.start(*FLAGS, "--log-dir", b.work / "logs" / "e-cap", "mode=capture", f"trace.dir={trace}", b.worker())
    time.sleep(3.0)  # the capture holds the trace by now (it takes the lock before anything else)
    emu = b.start(*FLAGS, "--log-dir", b.work / "logs" / "e-emu", "mode=emulate", f"trace.dir={trace}",
                  "sandbox.ranks=[1]", f"report.dir={b.work / 'e-report'}", b.worker())
    outs = {}
    for name, p in (("emulation", emu), ("capture", cap)):
        try:
            outs[name] = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            kill_tree(p)
            outs[name] = p.communicate()
    emu_err, cap_err = outs["emulation"][1], outs["capture"][1]
    named = re.search(rf"in use by another prism-launch \(pid {cap.pid} on host", emu_err) or \
        re.search(rf"in use by another prism-launch \(pid {emu.pid} on host", cap_err)
    refused = (emu.returncode != 0 and bool(named)) or (cap.returncode != 0 and bool(named))
    both_ok = emu.returncode == 0 and cap.returncode == 0
    waited = both_ok and "wait" in (emu_err + cap_err).lower() and bool(named)
    ok = bool(refused or waited) and (cap.returncode == 0 or emu.returncode == 0)
    seen = (f"capture rc={cap.returncode}, emulation rc={emu.returncode}; "
            + (f"refused naming the holder: {tail(named.group(0), 120)}" if named else "neither named the other")
            + ("" if ok else f"; emulation: {tail(emu_err, 200)}"))
    return Result("e", ok, what, seen)


# ----------------------------------------------------------------------------- (f)


def _listeners(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every TCP socket in LISTEN state owned by ``pids``."""
    out = []
    if shutil.which("ss"):
        text = subprocess.run(["ss", "-H", "-ltnp"], capture_output=True, text=True).stdout
        for line in text.splitlines():
            cols = line.split()
            if len(cols) < 4:
                continue
            for pid in map(int, re.findall(r"pid=(\d+)", line)):
                if pid in pids:
                    out.append((pid, cols[3]))
        return out
    for pid in pids:  # without ss: the tables of the process's namespace, matched by socket inode
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
        except OSError:
            continue
        for table in ("tcp", "tcp6"):
            try:
                rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                c = row.split()
                if c[3] == "0A" and c[9] in inodes:
                    out.append((pid, _hex_addr(c[1])))
    return out


def _hex_addr(hexaddr: str) -> str:
    import ipaddress

    addr, port = hexaddr.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def _loopback(addr: str) -> bool:
    import ipaddress

    host = addr.rsplit(":", 1)[0].strip("[]").split("%")[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # "*" or "0.0.0.0": every interface
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def case_f(b: Bench) -> Result:
    what = "(f) no socket of a single-node emulation (2 sandbox ranks) listens beyond loopback"
    trace = b.trace()
    p = b.start(*FLAGS, "--log-dir", b.work / "logs" / "f", "mode=emulate", f"trace.dir={trace}", "sandbox.ranks=[0,1]",
                f"report.dir={b.work / 'f-report'}", b.worker())
    seen: set[tuple[int, str]] = set()
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline:
        seen.update(_listeners(descendants(p.pid)))
        time.sleep(0.1)
    try:
        _out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        _out, err = p.communicate()
    wide = sorted({a for _, a in seen if not _loopback(a)})
    ok = bool(seen) and not wide and p.returncode == 0
    addrs = sorted({a for _, a in seen})
    detail = f"listening beyond loopback: {wide}" if wide else f"all {len(addrs)} on loopback: {addrs[:6]}"
    return Result("f", ok, what, f"emulation rc={p.returncode}; {len(seen)} listeners seen; {detail}"
                  + ("" if p.returncode == 0 else f"; {tail(err)}"))


CASES = {"a": case_a, "b": case_b, "c": case_c, "d": case_d, "e": case_e, "f": case_f}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=HERE, help="the checkout under test (default: this one)")
    ap.add_argument("--only", default="", help="comma-separated cases (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    repo = args.repo.resolve()
    work = Path(tempfile.mkdtemp(prefix="prism-security-"))
    todo = [c for c in (args.only.split(",") if args.only else CASES) if c]
    failed = 0
    print(f"security_faults: repo {repo} ({_head(repo)}), work {work}", flush=True)
    bench = Bench(repo, work)
    for name in todo:
        t0 = time.monotonic()
        try:
            r = CASES[name](bench)
        except Exception as e:  # noqa: BLE001 - a case that cannot run is a failure, said as such
            r = Result(name, False, f"({name})", f"could not run: {type(e).__name__}: {tail(str(e))}")
        failed += not r.ok
        print(f"{'PASS' if r.ok else 'FAIL'} {r.what}: {r.seen} [{time.monotonic() - t0:.0f}s]", flush=True)
    if args.keep:
        print(f"work folder kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{len(todo) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _head(repo: Path) -> str:
    r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "no git"


if __name__ == "__main__":
    sys.exit(main())
