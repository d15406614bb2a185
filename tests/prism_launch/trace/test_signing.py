"""Traces are signed by the user who wrote them; a trace read back is ``signed`` only under the
reader's own key and an unchanged manifest; the key is private and made once."""

import json
import os

import pytest

from prism_launch.trace import TraceReader
from prism_launch.trace.signing import SIGNATURE_NAME, Authorship, key_path, object_trust
from tests.prism_launch.trace.sample_trace import write_sample


@pytest.fixture(autouse=True)
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config"


def test_a_written_trace_is_signed_by_a_private_key_made_on_first_use(tmp_path, config_home):
    write_sample(tmp_path / "t")
    key = key_path()
    assert key == config_home / "prism-launch" / "trace.key"
    assert os.stat(key).st_mode & 0o777 == 0o600 and os.stat(key.parent).st_mode & 0o777 == 0o700
    assert len(key.read_bytes()) == 32
    assert TraceReader(tmp_path / "t").authorship() is Authorship.signed
    first = key.read_bytes()
    write_sample(tmp_path / "t2")
    assert key.read_bytes() == first  # made once
    assert object_trust(Authorship.signed, False, tmp_path / "t") == (True, None)


def test_another_users_key_makes_the_trace_foreign(tmp_path, monkeypatch):
    write_sample(tmp_path / "t")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "other-user"))
    assert TraceReader(tmp_path / "t").authorship() is Authorship.foreign


def test_a_manifest_edited_after_signing_is_foreign(tmp_path):
    write_sample(tmp_path / "t")
    path = tmp_path / "t" / "manifest.json"
    m = json.loads(path.read_text())
    m["extra"]["note"] = "edited"
    path.write_text(json.dumps(m))
    assert TraceReader(tmp_path / "t").authorship() is Authorship.foreign


def test_a_trace_without_signature_is_unsigned_and_says_how_to_lift_it(tmp_path):
    write_sample(tmp_path / "t")
    (tmp_path / "t" / SIGNATURE_NAME).unlink()
    who = TraceReader(tmp_path / "t").authorship()
    assert who is Authorship.unsigned
    trusted, note = object_trust(who, False, tmp_path / "t")
    assert not trusted and "is not signed" in note and "trace.trusted=true" in note
    assert object_trust(who, True, tmp_path / "t") == (True, None)


def test_a_key_folder_others_can_write_is_refused(tmp_path, config_home):
    (config_home / "prism-launch").mkdir(parents=True)
    os.chmod(config_home / "prism-launch", 0o777)
    with pytest.warns(RuntimeWarning, match="written unsigned .*is writable by group or others"):
        write_sample(tmp_path / "t")
    assert not (tmp_path / "t" / SIGNATURE_NAME).exists()
    assert TraceReader(tmp_path / "t").authorship() is Authorship.unsigned
