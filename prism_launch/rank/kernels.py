"""A calibration slice's kernels: the device time of every kernel the program ran in its first
steady step (step :data:`PROFILED_STEP`: from the end of step 1 to the end of step 2), by name,
taken with ``torch.profiler`` (CUDA activity only: no CPU op is recorded). The warm-up step is
not profiled: it also runs the program's one-time set-up (parameter buffers, optimizer state,
on an 8B shard a 46 ms device-to-device copy of 280 ms), which would tilt the mix. Tracing
kernels costs the host a little per launch, so calibration leaves the profiled step out of
the steady steps it pools where others remain (:func:`prism_launch.predict.calibrate.apply_spans`).
The predictor classifies the names (FLOP-bound, memory-bound, communication:
:mod:`prism_launch.predict.gpu_scaling`) to scale the slice's spans to another GPU, and sets
their sum against the step's calibrated spans: the share of the step the GPU was busy. On CPU
(tests, laptops) the same pass records torch's CPU ops and their self time instead.

Profiling never breaks the program it watches: a failure leaves ``{"error": ...}``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROFILED_STEP", "TOP", "StepKernels"]

PROFILED_STEP = 2
"""The profiled step (1-based): the first steady step; the profiler starts when step 1 ends."""
TOP = 200
"""Kernels kept by name, the longest first; the rest are summed into ``others_s``."""


class StepKernels:
    """:meth:`start` when the process group exists (the program has picked its device by then),
    :meth:`on_step` after every step; :meth:`summary` for the rank's summary."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.steps_done = 0
        self._armed = False
        self._prof: Any = None
        self.result: dict | None = None

    def start(self) -> None:
        """Arm the profiler: it runs from the end of step ``PROFILED_STEP - 1``."""
        self._armed = True
        if self.steps_done == PROFILED_STEP - 1:
            self._begin()

    def _begin(self) -> None:
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
        if self.steps_done == PROFILED_STEP - 1 and self._armed:
            self._begin()
        elif self.steps_done == PROFILED_STEP and self._prof is not None:
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
        if self._prof is not None:  # the program ended inside the profiled step
            try:
                self._prof.stop()
            except Exception:  # noqa: BLE001
                pass
            self._prof = None
            return {"error": f"the program ended before its step {PROFILED_STEP} did"}
        if self.result is None and self._armed:
            return {"error": f"the program ran {self.steps_done} step(s), fewer than the {PROFILED_STEP} whose last is profiled"}
        return self.result or {"error": "not started: the program created no process group"}
