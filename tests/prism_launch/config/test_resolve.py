"""resolve() makes every default concrete, once; each section refuses a bad value by name."""

from __future__ import annotations

import pytest

from prism_launch.config import (ComputeSource, ConfigError, DataPath, Device, Park, StartMethod, compose, resolve,
                                 validate)


def test_resolve_on_cpu_makes_every_auto_concrete():
    cfg = compose(["device=cpu", "target.world_size=128"])
    r = resolve(cfg)
    assert r.device is Device.cpu and not r.on_cuda
    assert r.launch.start_method is StartMethod.fork
    assert r.capture.park is Park.none and r.capture.fold is True and r.capture.slots >= 1
    assert r.emulate.data_path is DataPath.host and r.replay.compute is ComputeSource.cpu
    assert r.memory.enforce_limit is False and r.calibrate.in_auto is False and r.calibrate.slice_size >= 1
    assert resolve(r) == r  # idempotent
    assert cfg.capture.fold is None and cfg.launch.start_method is None  # a new value: the composed one is kept


def test_explicit_values_win():
    r = resolve(compose(["device=cpu", "target.world_size=8", "capture.fold=true", "calibrate.slice_size=3",
                         "memory.enforce_limit=true", "launch.start_method=spawn"]))
    assert r.capture.fold is True and r.calibrate.slice_size == 3 and r.memory.enforce_limit is True
    assert r.launch.start_method is StartMethod.spawn


@pytest.mark.parametrize("override, field", [
    ("sandbox.ranks=[9]", "sandbox.ranks"),
    ("comm.timeout_s=0", "comm.timeout_s"),
    ("comm.subgroups=sideways", "comm.subgroups"),
    ("emulate.window=0", "emulate.window"),
    ("emulate.prefetch.threads=0", "emulate.prefetch.threads"),
    ("calibrate.slice_size=0", "calibrate.slice_size"),
    ("launch.teardown_timeout_s=0", "launch.teardown_timeout_s"),
    ("report.loss_pattern=loss", "report.loss_pattern"),
    ("replay.timeline_max_ranks=0", "replay.timeline_max_ranks"),
    ("trace.ignore_args=[out]", "trace.ignore_args"),
    ("integration.kind=nope", "integration.kind"),
    ("compat.integrations=[nope]", "compat.integrations"),
    ("integration.moe=nope", "integration.moe"),
    ("physical.nodes=2", "physical.nodes"),
    ("capture.switch_interval_us=-1", "capture.switch_interval_us"),
    ("capture.gpu_exchange_mib=-1", "capture.gpu_exchange_mib"),
    ("capture.tp_sample=-1", "capture.tp_sample"),
    ("capture.ep_sample=-1", "capture.ep_sample"),
])
def test_each_section_refuses_a_bad_value_by_name(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(resolve(compose(["device=cpu", "target.world_size=8", override])))
