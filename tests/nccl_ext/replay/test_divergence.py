"""Divergences by kind (nccl_ext/replay/divergence.py): value beyond tolerance, non-deterministic
kernels within it, host scalars by size and call site; strict fails on values only."""

import warnings

import pytest
import torch

from nccl_ext.device_path.checks import SLOT_BYTES, DeviceChecks
from nccl_ext.device_path.stats import PrefetchStats
from nccl_ext.core import wire
from nccl_ext.replay.divergence import DivergenceLog, Kind, piece_stats
from nccl_ext.core.groups import GroupInfo
from nccl_ext.replay.summary import ReplayStats

GROUP = GroupInfo(ranks=(0, 1), key="0,1#0", occurrence=0, desc="dp")


def _log(strict=False, **kw):
    return DivergenceLog(0, ReplayStats(), strict=strict, **kw)


def _issued_from(path: str, fn, *args, function: str = "caller"):
    """Call ``fn`` from ``function`` in a file ``path`` (as a collective issued from that module)."""
    scope = {"fn": fn, "args": args}
    exec(compile(f"def {function}():\n    return fn(*args)\nout = {function}()", path, "exec"), scope)
    return scope["out"]


def test_rounding_of_a_non_deterministic_kernel_is_within_tolerance():
    rec = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    live = rec * (1 + 1e-7)  # last-place differences, as atomics reordering gives
    kind, _site, diff = _log().classify([live], [rec])
    assert kind is Kind.tolerance and 0 < diff["max_abs_diff"] < 1e-5


def test_a_changed_value_is_a_value_divergence_with_its_differences():
    rec = torch.ones(1000)
    live = rec.clone()
    live[7] = 1.5
    kind, _site, diff = _log().classify([live], [rec])
    assert kind is Kind.value and diff["max_abs_diff"] == 0.5 and diff["max_rel_diff"] == 0.5


def _recorded(*tensors):
    """What an exact trace keeps of a sandbox rank's own contribution: meta, digests, statistics."""
    return ([tuple(t.shape) for t in tensors], [wire.dtype_name(t.dtype) for t in tensors],
            [wire.digest(t) for t in tensors], [piece_stats(t) for t in tensors])


def test_statistics_alone_tell_rounding_from_a_changed_value():
    rec = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    same = torch.arange(4)
    noisy = rec * (1 + 1e-7)
    kind, _site, diff = _log().classify_stats([noisy, same], *_recorded(rec, same))
    assert kind is Kind.tolerance and 0 < diff["l1_rel_diff"] < 1e-5 and diff["max_abs_rel_diff"] < 1e-5
    changed = rec.clone()
    changed[7] += 0.5  # one element: the L1 norm moves by far more than the tolerance
    kind, _site, diff = _log().classify_stats([changed, same], *_recorded(rec, same))
    assert kind is Kind.value and diff["l1_rel_diff"] > 1e-4
    kind, _site, _ = _log().classify_stats([noisy, same + 1], *_recorded(rec, same))  # integer data: exact only
    assert kind is Kind.value
    kind, _site, _ = _log().classify_stats([rec[:10]], *_recorded(rec))  # another shape
    assert kind is Kind.value
    with pytest.raises(RuntimeError, match="emulate.strict=true"):
        log = _log(strict=True)
        log.report(*log.classify_stats([changed], *_recorded(rec))[:1], step=0, op="allreduce", group=GROUP,
                   seq=0, detail="x")


def test_integer_data_is_never_within_tolerance_and_rtol_is_configurable():
    rec = torch.arange(100)
    live = rec.clone()
    live[0] += 1
    assert _log(rtol=1.0).classify([live], [rec])[0] is Kind.value
    f = rec.float()
    assert _log(rtol=0.5).classify([f * 1.01], [f])[0] is Kind.tolerance
    assert _log(rtol=1e-4).classify([f * 1.01], [f])[0] is Kind.value


def test_shapes_that_differ_are_values():
    assert _log().classify([torch.ones(3)], [torch.ones(4)])[0] is Kind.value


def test_host_scalars_are_told_by_size_and_call_site_not_by_value():
    times = torch.tensor([0.012, 0.003, 0.5])
    other = times * 1.7  # another run's wall-clock times
    log = _log(strict=True)
    kind, site, _ = _issued_from("/x/megatron/core/timers.py", log.classify, [other], [times])
    assert kind is Kind.host_scalar and site.startswith("/x/megatron/core/timers.py")
    # the same small tensor from the training script (a loss, say) is a value divergence
    assert _issued_from("/x/pretrain_gpt.py", log.classify, [other], [times])[0] is Kind.value
    # and a large tensor from the timers' module is not a host scalar either
    big = torch.ones(65)
    assert _issued_from("/x/megatron/core/timers.py", log.classify, [big * 2], [big])[0] is Kind.value


def test_a_site_can_name_the_function_megatron_all_reduces_start_times_but_not_losses_from():
    log, path = _log(), "/x/megatron/training/training.py"
    start, other = torch.tensor([1.7e9], dtype=torch.float64), torch.tensor([1.7e9 + 3], dtype=torch.float64)
    assert _issued_from(path, log.classify, [other], [start], function="pretrain")[0] is Kind.host_scalar
    loss = torch.tensor([2.5, 4096.0])  # train_step's loss sum and token count
    assert _issued_from(path, log.classify, [loss * 1.5], [loss], function="train_step")[0] is Kind.value


def test_strict_fails_on_values_only_and_counts_every_kind():
    log = _log(strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in (Kind.tolerance, Kind.host_scalar, Kind.tolerance):
            log.report(kind, step=1, op="all_reduce", group=GROUP, seq=3, detail="x", max_abs_diff=1e-7)
        with pytest.raises(RuntimeError, match=r"divergence \(value\).*emulate.strict=true"):
            log.report(Kind.value, step=2, op="all_reduce", group=GROUP, seq=4, detail="x")
    assert log.stats.divergence_counts == {"tolerance": 2, "host_scalar": 1, "value": 1}
    first = log.stats.divergences[0]
    assert (first["kind"], first["step"], first["op"], first["group"], first["seq"]) == ("tolerance", 1, "all_reduce", [0, 1], 3)
    assert first["max_abs_diff"] == 1e-7


def test_device_checks_carry_the_live_norm_that_classifies_a_mismatch():
    checks = DeviceChecks(PrefetchStats())
    checks.attach(torch.zeros(SLOT_BYTES, dtype=torch.uint8))
    from nccl_ext.device_path.checks import word_sum

    rec = torch.randn(256, generator=torch.Generator().manual_seed(1))
    nudged, changed, ints = rec * (1 + 1e-7), rec.clone(), torch.arange(8, dtype=torch.int32)
    changed[0] += 3
    checks.verify([rec], [word_sum(rec)], "same")
    checks.verify([nudged, changed], [word_sum(rec), word_sum(rec)], "a2a")
    checks.verify([ints + 1], [word_sum(ints)], "ints")
    bad = checks.flush()
    assert [(w, i) for w, i, *_ in bad] == [("a2a", 0), ("a2a", 1), ("ints", 0)]
    log = _log()
    kinds = [log.classify_norms(dt, norm, ref, numel, None)[0]
             for (_w, _i, dt, numel, norm), ref in zip(bad, [rec, rec, ints])]
    assert kinds == [Kind.tolerance, Kind.value, Kind.value]
    assert bad[0][3] == 512 and bad[2][4] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_piece_statistics_are_the_float64_norm_and_the_exact_max_abs(dtype):
    t = (torch.randn(3, 4099, generator=torch.Generator().manual_seed(1)) * 7).to(dtype)
    t[1, 5] = -1000  # the largest magnitude is negative
    ws, l1, mx = piece_stats(t)
    ref = t.double().abs()
    assert ws == piece_stats(t.clone())[0] and isinstance(ws, int)
    assert abs(l1 - float(ref.sum())) <= 1e-12 * float(ref.sum())
    assert mx == float(ref.max()) == 1000.0
    assert piece_stats(torch.arange(5))[1:] == [None, None]  # integers: the word sum only
