"""Who wrote a trace: its manifest signed with the user's key, and the check of a trace read back.

A trace is code as much as data: emulation hands its recorded object-collective payloads
(``broadcast_object_list`` …) to torch, which unpickles them. The manifest's sha256 sums catch
corruption, not authorship. So the writer signs the manifest's canonical bytes
(:meth:`~.manifest.Manifest.canonical_bytes`, which include every file's sum) with
HMAC-SHA256 under a per-user key, and puts the signature beside the manifest
(:data:`SIGNATURE_NAME`). The key is 32 random bytes made on first use, kept ``0600`` at
``$XDG_CONFIG_HOME/prism-launch/trace.key`` (else ``~/.config/prism-launch/trace.key``), its
folder ``0700`` and checked like every private folder (:mod:`prism_launch.config.private_dirs`).

:func:`authorship` says what a trace read back is: ``signed`` (by this user's key: replayed
as it is), ``unsigned`` or ``foreign`` (a signature that this key did not make, or a manifest
changed since it was signed). Emulation of the last two unpickles object payloads through an
allow-list only (:mod:`nccl_ext.frontend.safe_unpickle`) unless ``trace.trusted=true``.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from prism_launch.config.private_dirs import check_private, ensure_private_dir

from .durable import write_bytes_durable
from .errors import TraceUnsafeError
from .manifest import Manifest

__all__ = ["SIGNATURE_NAME", "Authorship", "TraceUnsafeError", "authorship", "key_path", "object_trust", "sign",
           "signature_bytes"]

SIGNATURE_NAME = "manifest.sig"
"""Beside ``manifest.json``: ``{"alg": "hmac-sha256", "key_id": ..., "mac": ...}``."""

_ALG = "hmac-sha256"
_KEY_BYTES = 32
_KEY_HINT = "Remove the folder if it is yours (a new key is made; traces signed with the old one are then foreign)."


class Authorship(enum.StrEnum):
    signed = "signed"
    """Signed with this user's key, manifest unchanged since."""
    unsigned = "unsigned"
    """No signature (written before traces were signed, or elsewhere)."""
    foreign = "foreign"
    """Signed, but not by this key over this manifest (another user's trace, or edited)."""


def key_path() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg else Path.home() / ".config"
    return base / "prism-launch" / "trace.key"


def _load_key(*, create: bool) -> bytes | None:
    """This user's trace key (made on first use when ``create``); None when there is none."""
    path = key_path()
    if create:
        ensure_private_dir(path.parent, hint=_KEY_HINT)
    else:
        try:
            check_private(path.parent, hint=_KEY_HINT)
        except FileNotFoundError:
            return None
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            return None
    # first use: write a private temporary file, then link it in place (the first process wins)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise TraceUnsafeError(f"the trace signing key {path} is not private to you (owner uid {st.st_uid}, "
                                   f"mode {st.st_mode & 0o777:04o}); remove it (a new one is made) or "
                                   f"`chmod 600 {path}` if it is yours")
        key = f.read(_KEY_BYTES + 1)
    if len(key) != _KEY_BYTES:
        raise TraceUnsafeError(f"the trace signing key {path} is not {_KEY_BYTES} bytes; remove it (a new one is made)")
    return key


def _key_id(key: bytes) -> str:
    return hashlib.sha256(b"prism-launch trace key id\0" + key).hexdigest()[:16]


def signature_bytes(manifest: Manifest) -> bytes:
    """The signature file's contents for ``manifest``, made with this user's key (created on
    first use)."""
    key = _load_key(create=True)
    mac = hmac.new(key, manifest.canonical_bytes(), hashlib.sha256).hexdigest()
    return (json.dumps({"alg": _ALG, "key_id": _key_id(key), "mac": mac}, sort_keys=True) + "\n").encode()


def sign(trace_dir: str | Path, manifest: Manifest) -> Path:
    """Write the signature of ``manifest`` into ``trace_dir`` (a trace being written or a
    trace rewritten by its owner); returns the signature's path."""
    path = Path(trace_dir) / SIGNATURE_NAME
    write_bytes_durable(path, signature_bytes(manifest))
    os.chmod(path, 0o644)  # whatever the umask: a reader refuses a signature others could replace
    return path


def authorship(trace_dir: str | Path, manifest: Manifest) -> Authorship:
    """Whether the trace at ``trace_dir`` (whose manifest was read as ``manifest``) is signed
    by this user; never creates a key (a user without one has signed nothing)."""
    path = Path(trace_dir) / SIGNATURE_NAME
    try:
        check_private(path, directory=False)
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return Authorship.unsigned
    except (OSError, ValueError):  # unreadable, a link, writable by others: vouches for nothing
        return Authorship.foreign
    key = _load_key(create=False)
    if key is None or not isinstance(raw, dict) or raw.get("alg") != _ALG or not isinstance(raw.get("mac"), str):
        return Authorship.foreign
    expected = hmac.new(key, manifest.canonical_bytes(), hashlib.sha256).hexdigest()
    return Authorship.signed if hmac.compare_digest(expected, raw["mac"]) else Authorship.foreign


def object_trust(who: Authorship, trusted: bool, trace_dir: str | Path) -> tuple[bool, str | None]:
    """Whether emulation may unpickle the trace's object payloads as they are, and the line
    that says why not (None when nothing needs saying): a trace this user signed, or any
    trace under ``trace.trusted=true``."""
    if who is Authorship.signed or trusted:
        return True, None
    why = "is not signed" if who is Authorship.unsigned else "is signed by another key (another user's, or edited)"
    return False, (f"the trace {trace_dir} {why}: its object-collective payloads are unpickled through an "
                   "allow-list (plain data, tensors, the frameworks' dataclasses); re-capture it, or pass "
                   "trace.trusted=true if you trust its author")
