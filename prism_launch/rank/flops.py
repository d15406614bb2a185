"""A capture rank's model FLOPs and tokens of one training step, counted where the program
runs them, and the device it measures on.

:class:`StepFlops` enters torch's ``FlopCounterMode`` (a TorchDispatchMode: it composes with
the CPU compatibility layer's TorchFunctionMode, which sits on the other mode stack) when the
first step ends and leaves it when the second ends, so it counts step 2 alone: the first
step is warm-up (lazy allocations, compilation) and every later step repeats it. The count is
the matmul/attention FLOPs of the forward, the backward and any recompute the program really
runs. The same pass sums, per embedding table, the token ids looked up: the tokens this rank's
pipeline stage embedded in the step (word and position tables see the same ids; the largest
sum is taken). Counting costs Python per torch op, for one step of each captured rank only.
A program that runs torch.compile'd code by the end of step 1 is not counted (a dispatch mode
stops compiled frames and cannot see their kernels): its summary says so, and the report's
FLOPs and MFU are unknown.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

__all__ = ["COUNTED_STEP", "StepFlops", "compiled_frames", "device_info"]

COUNTED_STEP = 2
"""The step counted (1-based): the first after warm-up."""


class StepFlops:
    """Counts step :data:`COUNTED_STEP`'s FLOPs; :meth:`on_step` is called after every step."""

    def __init__(self) -> None:
        self.steps_done = 0
        self._counter: Any = None
        self._t0 = 0.0
        self._tables: dict[tuple, int] = {}
        self._uncounted: dict[str, str] = {}
        """Ops of the counting registry whose FLOPs could not be counted -> why."""
        self.result: dict | None = None

    def _embedding(self, weight_shape, indices_shape, *args, out_shape=None, **kwargs) -> int:
        n = 1
        for d in indices_shape:
            n *= int(d)
        key = tuple(weight_shape)
        self._tables[key] = self._tables.get(key, 0) + n
        return 0  # a lookup: no FLOPs

    def on_step(self) -> None:
        self.steps_done += 1
        try:
            if self.steps_done == COUNTED_STEP - 1:
                self._start()
            elif self.steps_done == COUNTED_STEP and self._counter is not None:
                self._stop(complete=True)
        except Exception as e:  # noqa: BLE001 - counting never breaks the program it watches
            self._counter = None
            self.result = {"step": COUNTED_STEP, "error": f"{type(e).__name__}: {e}"}

    def _start(self) -> None:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        compiled = compiled_frames()
        if compiled:
            # torch.compile refuses to run (fullgraph) or falls back to eager under a non-infra
            # dispatch mode, and a compiled graph's kernels are invisible to one anyway
            self.result = {"step": COUNTED_STEP, "flops": None, "complete": False,
                           "skipped": f"the program runs torch.compile'd code ({compiled} frame(s) compiled by the "
                                      "end of step 1): FlopCounterMode, a dispatch mode, would stop its compiled "
                                      "frames and cannot see inside them"}
            return

        mapping = {torch.ops.aten.embedding: self._embedding}
        self._counter = FlopCounterMode(display=False, custom_mapping=mapping)
        self._t0 = time.perf_counter()
        self._counter.__enter__()
        _run_programs_kernels(self._counter, self._uncounted)

    def _stop(self, complete: bool) -> None:
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        self.result = {
            "step": COUNTED_STEP,
            "flops": int(counter.get_total_flops()),
            "embedded_tokens": max(self._tables.values()) if self._tables else None,
            "complete": complete,
            "uncounted_ops": dict(self._uncounted) or None,
            "counting_wall_s": round(time.perf_counter() - self._t0, 6),
            "counted_by": "torch.utils.flop_counter.FlopCounterMode",
        }

    def summary(self) -> dict | None:
        """The count (None before it began); a step begun but not ended is marked incomplete."""
        if self._counter is not None:
            try:
                self._stop(complete=False)
            except Exception as e:  # noqa: BLE001
                self.result = {"step": COUNTED_STEP, "error": f"{type(e).__name__}: {e}"}
        return self.result


def compiled_frames() -> int:
    """Frames torch.compile (Dynamo) has compiled in this process so far; 0 when Dynamo was never
    imported (it is not imported here for the asking)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return 0
    try:
        return int(counters["frames"]["ok"]) or int(counters["stats"]["unique_graphs"])
    except (KeyError, TypeError, ValueError):
        return 0


def _run_programs_kernels(counter, uncounted: dict[str, str]) -> None:
    """Make the entered ``counter`` run every op with the kernel the program would run.

    FlopCounterMode replaces an op outside its FLOP registry that has a composite definition by
    that decomposition (``func.decompose()``, to find matmuls inside it): ``silu_backward`` in
    bfloat16 then runs as separate bfloat16 elementwise ops and rounds differently from its
    fused kernel, so the counted step's gradients would differ from every other run of the
    program (an emulation replaying the capture, the real job). Counting only the ops the
    program really dispatches keeps its numbers bit for bit; composite ops with a matmul inside
    reach the dispatch modes already decomposed (their kernels are registered below autograd)."""
    mode = getattr(counter, "mode", None)
    if mode is None or getattr(type(mode), "__prism_exact__", False):
        return
    base = type(mode)

    class _ProgramKernels(base):  # type: ignore[misc, valid-type]
        __prism_exact__ = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            if isinstance(func, torch._ops.HigherOrderOperator):
                return super().__torch_dispatch__(func, types, args, kwargs)
            kwargs = kwargs or {}
            out = func(*args, **kwargs)  # not counted when outside the registry: no FLOPs, never decomposed
            if func._overloadpacket in self.counter.flop_registry:
                count_op(self.counter, func, out, args, kwargs, uncounted)
            return out

    mode.__class__ = _ProgramKernels


def count_op(counter, func, out, args, kwargs, uncounted: dict[str, str]) -> None:
    """Count one op of ``counter``'s registry (what ``FlopCounterMode`` does after running it). Its
    formula may refuse shapes the kernel takes — torch's attention formulas assert one head count
    for query, key and value, while grouped-query attention passes fewer key/value heads — so a
    refused op is counted again with every 4-D operand's heads widened to the query's (each query
    head attends over its group's key/value head: the FLOPs of ungrouped attention); an op still
    refused is left out and named in ``uncounted``, never failing the program."""
    packet = func._overloadpacket
    try:
        counter._count_flops(packet, out, args, kwargs)
        return
    except Exception as first:  # noqa: BLE001 - counting never breaks the program it watches
        error = first
    widened = _heads_widened(args)
    if widened is not None:
        try:
            counter._count_flops(packet, out, widened, kwargs)
            return
        except Exception as again:  # noqa: BLE001
            error = again
    uncounted.setdefault(str(packet), f"{type(error).__name__}: {error}")


def _heads_widened(args: tuple) -> tuple | None:
    """``args`` with each 4-D tensor (batch, heads, sequence, channels) whose heads divide the most
    heads among them replaced by a meta tensor of that many heads; None when nothing is grouped."""
    import torch

    four = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not four:
        return None
    heads = max(int(a.shape[1]) for a in four)
    if all(int(a.shape[1]) == heads for a in four) or any(heads % max(1, int(a.shape[1])) for a in four):
        return None

    def widen(a):
        if isinstance(a, torch.Tensor) and a.dim() == 4 and int(a.shape[1]) != heads:
            return torch.empty((a.shape[0], heads, a.shape[2], a.shape[3]), dtype=a.dtype, device="meta")
        return a

    return tuple(widen(a) for a in args)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_info(device: str) -> dict:
    """The device this rank measures its compute spans on: for CUDA, ``get_device_properties``
    (name, SMs, memory, clocks and bus width where this torch exposes them, and the bandwidth
    they give); for the CPU, its model and core count."""
    if device != "cuda":
        return {"kind": "cpu", "name": _cpu_model(), "cores": os.cpu_count()}
    import torch

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    out: dict = {"kind": "cuda", "name": p.name, "sm_count": p.multi_processor_count,
                 "memory_bytes": int(p.total_memory), "capability": f"{p.major}.{p.minor}"}
    for attr in ("clock_rate", "memory_clock_rate", "memory_bus_width", "L2_cache_size"):
        v = getattr(p, attr, None)
        if v is not None:
            out[attr] = int(v)
    if out.get("memory_clock_rate") and out.get("memory_bus_width"):  # kHz, bits; DDR: 2 transfers a clock
        out["memory_bandwidth_bytes_s"] = 2 * out["memory_clock_rate"] * 1e3 * out["memory_bus_width"] / 8
    return out


def measuring_device(summaries: dict, device: str) -> dict | None:
    """The device a capture's spans were measured on, for its manifest: the lowest captured
    rank's report; with none (no rank reported), this machine's CPU for ``device=cpu``, else None."""
    for r in sorted(summaries, key=int):
        info = (summaries[r] or {}).get("device")
        if info:
            return info
    return device_info("cpu") if device == "cpu" else None
