"""Fitting one link's per-hop latency and bandwidth to measured collective times, with the
single-link formulas of :class:`~prism_launch.predict.cost_model.NcclCostModel` (what
``netbench`` does with its measurements)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from prism_launch.predict.cost_model import COLLECTIVE_KINDS, GB, US, KindCost, LinkSpec, _check_kind, _link_coefficients

__all__ = ["fit_alpha_beta", "fit_link"]


def fit_link(
    samples: Iterable[tuple[str, int, int, float]],
    *,
    protocol_latency_us: float = 0.0,
) -> LinkSpec:
    """Fit one link's α (µs per hop) and bandwidth from ``(kind, p, nbytes, seconds)`` samples
    of ops whose members all share that link (e.g. several kinds measured on one node).

    Model: ``seconds = protocol + steps(kind, p) × α + coef(kind, p) × nbytes / B`` (the
    single-link formulas of :class:`NcclCostModel`). The fit is linear least squares on
    relative error (each sample weighted by ``1 / seconds``), so small, latency-bound
    sizes count as much as large ones; α is kept >= 0.
    """
    rows: list[tuple[float, float, float]] = []
    for kind, p, nbytes, seconds in samples:
        kind = _check_kind(kind, allow_p2p=True)
        if p < 2:
            raise ValueError(f"cannot fit from a group of {p} rank(s); need p >= 2")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"sample time must be a finite number > 0 s (got {seconds!r})")
        steps, coef = _link_coefficients(kind, p)
        y = seconds - protocol_latency_us * US
        w = 1.0 / seconds
        rows.append((steps * w, coef * nbytes * w, y * w))
    if len({r[1] / r[0] for r in rows if r[0]}) < 2:
        raise ValueError("fitting α and bandwidth needs samples at two or more distinct sizes")
    # Normal equations of  y ≈ a·x_a + b·x_b   with a = α (s), b = 1/B (s/byte).
    saa = sum(r[0] * r[0] for r in rows)
    sab = sum(r[0] * r[1] for r in rows)
    sbb = sum(r[1] * r[1] for r in rows)
    say = sum(r[0] * r[2] for r in rows)
    sby = sum(r[1] * r[2] for r in rows)
    det = saa * sbb - sab * sab
    if det <= 0:
        raise ValueError("fitting α and bandwidth needs samples at two or more distinct sizes")
    a = (say * sbb - sby * sab) / det
    b = (saa * sby - sab * say) / det
    if a < 0:  # latency below resolution: constrain α = 0 and refit the slope alone
        a, b = 0.0, sby / sbb
    if b <= 0:
        raise ValueError(
            "the measured times do not grow with the size, so no bandwidth can be fitted; "
            "measure larger sizes"
        )
    return LinkSpec(bandwidth_gbps=1.0 / b / GB, latency_us=a / US)


def fit_alpha_beta(
    samples: list[tuple[int, float]],
    kind: str,
    p: int,
    *,
    protocol_latency_us: float = 0.0,
) -> LinkSpec:
    """Least-squares α/β of a link from ``(nbytes, seconds)`` measurements of collective
    ``kind`` (or ``"p2p"``) over ``p`` ranks sharing that link.

    ``nbytes`` has the meaning of the module table. The fixed ``protocol_latency_us`` is
    subtracted first; with the default 0 the whole fixed cost is attributed to the hops
    (``latency_us`` is then the per-hop share of it).
    """
    return fit_link(((kind, p, n, t) for n, t in samples), protocol_latency_us=protocol_latency_us)


def round_sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (non-finite and zero values as they are)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def kind_costs(fits: dict[str, LinkSpec]) -> dict[str, KindCost]:
    """Per-kind link fits (collective kinds only) as ``cluster.kinds``, each to 4 significant digits."""
    return {kind: KindCost(latency_us=round_sig(f.latency_us), bandwidth_gbps=round_sig(f.bandwidth_gbps))
            for kind, f in fits.items() if kind in COLLECTIVE_KINDS}
