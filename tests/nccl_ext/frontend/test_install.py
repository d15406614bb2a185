"""``install(subgroups=...)``: how ``dist.new_group`` reaches the prism world — the default group
taking it (torch >= 2.13 delegates) or torch's group helper intercepted (the older torch's path,
on any torch) — and a clear error for anything else. Each case runs in a fresh interpreter:
``install`` patches torch for the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nccl_ext.frontend import install
from tests.conftest import ROOT, _env

SCRIPT = textwrap.dedent("""
    import sys

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from nccl_ext.frontend import install
    from nccl_ext.frontend.process_group import PrismProcessGroup


    class Transport:
        timeout_s = 30.0

        def __init__(self):
            self.groups = []

        def register_group(self, group):
            self.groups.append(group.ranks)

        def close(self):
            pass


    transport = Transport()
    install.install(rank=1, world_size=4, make_transport=lambda *_: transport, timeout_s=30.0,
                    subgroups=sys.argv[1])
    helper = c10d._new_process_group_helper
    dist.init_process_group("gloo")
    sub = dist.new_group([1, 3])
    default = c10d._get_default_group()
    print(type(default).__name__, hasattr(default, "new_group"), isinstance(sub, PrismProcessGroup),
          helper.__module__ == "nccl_ext.frontend.install", transport.groups[-1], sub.size())
""")


def _run(subgroups: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, subgroups], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)


def test_auto_delegates_when_this_torch_does():
    r = _run("auto")
    assert r.returncode == 0, r.stderr[-3000:]
    delegates = install._delegates_new_group()
    assert r.stdout.split() == ["DelegatingPrismProcessGroup" if delegates else "PrismProcessGroup",
                                str(delegates), "True", str(not delegates), "(1,", "3)", "2"]


def test_intercept_creates_subgroups_through_the_intercepted_helper():
    r = _run("intercept")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["PrismProcessGroup", "False", "True", "True", "(1,", "3)", "2"]


def test_delegate_requires_a_torch_that_delegates():
    r = _run("delegate")
    if install._delegates_new_group():
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.split() == ["DelegatingPrismProcessGroup", "True", "True", "False", "(1,", "3)", "2"]
    else:
        assert r.returncode != 0 and "subgroups='delegate'" in r.stderr


def test_an_unknown_subgroups_value_is_refused_by_name():
    with pytest.raises(ValueError, match=r"subgroups must be one of .* \(got 'never'\)"):
        install.install(rank=0, world_size=1, make_transport=None, timeout_s=1.0, subgroups="never")
