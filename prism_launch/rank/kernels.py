"""A calibration slice's kernels: the device time of every kernel the program ran from its
process group's creation to the end of its first step, by name, taken with ``torch.profiler``
(CUDA activity only: no CPU op is recorded, so the program's host side is not slowed). The
first step is warm-up, never a steady step of the calibrated spans, so profiling it moves no
span the prediction uses. The predictor classifies the names (FLOP-bound, memory-bound,
communication: :mod:`prism_launch.predict.gpu_scaling`) to scale the slice's spans to another
GPU. On CPU (tests, laptops) the same pass records torch's CPU ops and their self time instead.

Profiling never breaks the program it watches: a failure leaves ``{"error": ...}``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROFILED_STEP", "TOP", "StepKernels"]

PROFILED_STEP = 1
"""The step whose end stops the profiler (1-based): the warm-up step."""
TOP = 200
"""Kernels kept by name, the longest first; the rest are summed into ``others_s``."""


class StepKernels:
    """:meth:`start` when the process group exists (the program has picked its device by then),
    :meth:`on_step` after every step; :meth:`summary` for the rank's summary."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.steps_done = 0
        self._prof: Any = None
        self.result: dict | None = None

    def start(self) -> None:
        if self._prof is not None or self.result is not None:
            return
        try:
            from torch.profiler import ProfilerActivity, profile

            activity = ProfilerActivity.CUDA if self.device == "cuda" else ProfilerActivity.CPU
            self._prof = profile(activities=[activity])
            self._prof.start()
        except Exception as e:  # noqa: BLE001 - profiling never breaks the program it watches
            self._prof = None
            self.result = {"error": f"{type(e).__name__}: {e}"}

    def on_step(self) -> None:
        self.steps_done += 1
        if self.steps_done == PROFILED_STEP and self._prof is not None:
            self._stop()

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        try:
            if self.device == "cuda":
                import torch

                torch.cuda.synchronize()
            prof.stop()
            times: dict[str, float] = {}
            for evt in prof.key_averages():
                us = evt.self_device_time_total if self.device == "cuda" else evt.self_cpu_time_total
                if us and us > 0:
                    times[evt.key] = times.get(evt.key, 0.0) + us / 1e6
            ranked = sorted(times.items(), key=lambda kv: -kv[1])
            self.result = {"step": PROFILED_STEP, "activity": "cuda kernels" if self.device == "cuda" else "cpu ops",
                           "kernels": [[k, v] for k, v in ranked[:TOP]],
                           "others_s": sum(v for _, v in ranked[TOP:]), "total_s": sum(times.values())}
        except Exception as e:  # noqa: BLE001
            self.result = {"error": f"{type(e).__name__}: {e}"}

    def summary(self) -> dict:
        if self._prof is not None:  # the program ended inside its first step
            try:
                self._prof.stop()
            except Exception:  # noqa: BLE001
                pass
            self._prof = None
            return {"error": f"the program ended before its step {PROFILED_STEP} did"}
        return self.result or {"error": "not started: the program created no process group"}
