"""What the fidelity harnesses (``bench/fidelity.py`` on CPU, ``bench/gpu_fidelity.py`` on one
GPU) share and the tests check without running a job: one :class:`Pair` per interleaved
(real, predicted) run, a row of statistics per case (:func:`summarize`: mean/max error and
their spread), the table (:func:`table`), the machine it ran on (:func:`machine`) and the
self-check (:func:`failures`): a missing or non-finite value, or a goal missed, is a failure
— never a printed nan or 0."""

from __future__ import annotations

import math
import os
import platform
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Pair:
    """One real run and one prediction of the same job, run back to back."""

    real_step_s: float
    predicted_step_s: float
    real_peak_bytes: dict[int, int] = field(default_factory=dict)
    """Per-rank peak of the real run (allocator level)."""
    predicted_peak_bytes: dict[int, int] = field(default_factory=dict)
    """Per-rank peak the emulation's report gives (virtual ranks: the capture's; sandbox: its own)."""

    @property
    def time_error_pct(self) -> float:
        return 100 * (self.predicted_step_s - self.real_step_s) / self.real_step_s

    @property
    def memory_error_pct(self) -> float:
        """Largest |predicted - real| / real over the ranks both have (nan when none)."""
        common = [r for r in self.real_peak_bytes if r in self.predicted_peak_bytes]
        if not common:
            return float("nan")
        return max(100 * abs(self.predicted_peak_bytes[r] - self.real_peak_bytes[r]) / self.real_peak_bytes[r]
                   for r in common)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summarize(case: str, pairs: list[Pair], *, time_goal_pct: float | None = None,
              memory_goal_pct: float | None = None, time_max_goal_pct: float | None = None,
              absolute: bool = False, **extra) -> dict:
    """A case's row: means, spreads (sample standard deviation; 0 for one pair) and maxima.
    ``absolute``: ``time_goal_pct`` bounds the mean of |error| (errors of both signs do not
    cancel), else the signed mean; ``time_max_goal_pct`` bounds the largest |error|. The real
    runs' own spread (``real_spread_pct``: standard deviation over mean; ``real_range_pct``:
    (max - min) over mean) is what the errors are to be read against."""
    errs = [p.time_error_pct for p in pairs]
    mems = [p.memory_error_pct for p in pairs]
    reals = [p.real_step_s for p in pairs]
    sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
    real_mean = statistics.fmean(reals) if pairs else float("nan")
    return {
        "case": case, "pairs": len(pairs),
        "real_ms": 1e3 * real_mean,
        "real_sd_ms": 1e3 * sd(reals) if pairs else float("nan"),
        "real_spread_pct": 100 * sd(reals) / real_mean if pairs else float("nan"),
        "real_range_pct": 100 * (max(reals) - min(reals)) / real_mean if pairs else float("nan"),
        "predicted_ms": 1e3 * statistics.fmean(p.predicted_step_s for p in pairs) if pairs else float("nan"),
        "predicted_sd_ms": 1e3 * sd([p.predicted_step_s for p in pairs]) if pairs else float("nan"),
        "error_mean_pct": statistics.fmean(errs) if errs else float("nan"),
        "error_abs_mean_pct": statistics.fmean(map(abs, errs)) if errs else float("nan"),
        "error_abs_max_pct": max(map(abs, errs)) if errs else float("nan"),
        "error_sd_pct": sd(errs) if errs else float("nan"),
        "memory_error_max_pct": max(mems) if mems else float("nan"),
        "time_goal_pct": time_goal_pct, "time_max_goal_pct": time_max_goal_pct, "goal_absolute": absolute,
        "memory_goal_pct": memory_goal_pct, **extra,
    }


def failures(rows: list[dict]) -> list[str]:
    """What is wrong with the rows: a value missing or not finite, or a goal missed (mean
    time error beyond ``time_goal_pct`` in absolute value — the mean of |error| where the row's
    goal is ``goal_absolute`` —, largest |error| beyond ``time_max_goal_pct``, memory error
    beyond its goal)."""
    out = []
    for r in rows:
        for k in ("real_ms", "predicted_ms", "error_mean_pct", "memory_error_max_pct"):
            if not _finite(r.get(k)):
                out.append(f"{r['case']}: {k} is {r.get(k)!r} (missing or not finite)")
        if not r.get("pairs"):
            out.append(f"{r['case']}: no pairs ran")
        g = r.get("time_goal_pct")
        key, what = (("error_abs_mean_pct", "mean |iteration-time error|") if r.get("goal_absolute")
                     else ("error_mean_pct", "mean iteration-time error"))
        if g is not None and _finite(r.get(key)) and abs(r[key]) > g:
            shown = f"{r[key]:.2f}%" if r.get("goal_absolute") else f"{r[key]:+.2f}%"
            out.append(f"{r['case']}: {what} {shown} beyond the goal {'' if r.get('goal_absolute') else '±'}{g}%")
        g = r.get("time_max_goal_pct")
        if g is not None and _finite(r.get("error_abs_max_pct")) and r["error_abs_max_pct"] > g:
            out.append(f"{r['case']}: largest |iteration-time error| {r['error_abs_max_pct']:.2f}% beyond the goal {g}%")
        g = r.get("memory_goal_pct")
        if g is not None and _finite(r.get("memory_error_max_pct")) and r["memory_error_max_pct"] > g:
            out.append(f"{r['case']}: peak-memory error {r['memory_error_max_pct']:.4f}% beyond the goal {g}%")
    return out


def table(rows: list[dict]) -> str:
    """One line per case: real and predicted means (sd), the real runs' own spread beside the
    errors (mean signed, mean |error|, largest |error|, sd), memory error and the goals."""
    head = (f"{'case':34} {'pairs':>5} {'real ms (sd)':>16} {'real spread':>11} {'predicted ms (sd)':>18} "
            f"{'err mean':>9} {'|err| mean':>10} {'|err| max':>9} {'err sd':>7} {'mem err max':>11} {'goal':>12}")
    lines = [head]

    def cell(r: dict, key: str, spec: str, width: int, unit: str = "") -> str:
        """A value, or MISSING where it is missing or not finite (never a printed nan)."""
        v = r.get(key)
        return f"{format(v, spec)}{unit}" if _finite(v) else f"{'MISSING':>{width}}"

    for r in rows:
        goal = "" if r.get("time_goal_pct") is None else f"{'|' if r.get('goal_absolute') else ''}±{r['time_goal_pct']:g}%"
        if r.get("time_max_goal_pct") is not None:
            goal += f",{r['time_max_goal_pct']:g}%"
        lines.append(
            f"{r['case']:34} {r['pairs']:5d} {cell(r, 'real_ms', '9.2f', 9)} ({cell(r, 'real_sd_ms', '5.2f', 5)}) "
            f"{cell(r, 'real_spread_pct', '10.2f', 11, '%')} "
            f"{cell(r, 'predicted_ms', '10.2f', 10)} ({cell(r, 'predicted_sd_ms', '5.2f', 5)}) "
            f"{cell(r, 'error_mean_pct', '+8.2f', 9, '%')} {cell(r, 'error_abs_mean_pct', '9.2f', 10, '%')} "
            f"{cell(r, 'error_abs_max_pct', '8.2f', 9, '%')} "
            f"{cell(r, 'error_sd_pct', '6.2f', 7, '%')} {cell(r, 'memory_error_max_pct', '10.4f', 11, '%')} {goal:>12}")
    return "\n".join(lines)


def machine() -> str:
    """The machine in words: host, CPU model and cores (and the GPU when CUDA is there), torch."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [platform.node(), f"{cpu} × {len(os.sched_getaffinity(0))} cores"]
    try:
        import torch

        if torch.cuda.is_available():
            parts.append(f"{torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}")
        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"
