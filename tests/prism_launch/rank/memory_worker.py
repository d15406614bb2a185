"""Subprocess body for test_memory: late start under the CPU compatibility layer.

Allocates tensors before the tracker starts, installs ``integrations.cpu_compat``
(a TorchFunctionMode kept for the whole process), then measures a few steps of
a small model written for CUDA. Prints one JSON line.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

PRE_BYTES = 123_456
pre = torch.empty(PRE_BYTES, dtype=torch.uint8)  # allocated before any hook exists

from integrations import cpu_compat  # noqa: E402

cpu_compat.install()

from prism_launch.rank.memory import MemoryTracker, set_memory_limit  # noqa: E402

out: dict = {}
tracker = MemoryTracker("cuda")  # no CUDA here: measured on CPU, and said so
tracker.start()
out["start_current"] = tracker.current_bytes()

a = torch.empty(1000, device="cuda")  # the layer sends it to the CPU allocator
out["a_device"] = a.device.type
out["after_a"] = tracker.current_bytes()
del pre  # a block the hook never saw: freeing it changes nothing
out["after_free_pre"] = tracker.current_bytes()
del a

torch.manual_seed(0)
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 64, device="cuda")
param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
out["param_bytes"] = param_bytes
out["x_bytes"] = x.numel() * x.element_size()
units = []
for step in range(3):
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    s = tracker.mark_unit(step)
    units.append({"unit": s.unit, "current": s.current_bytes, "peak": s.peak_bytes})
out["units"] = units
out["current"] = tracker.current_bytes()

set_memory_limit("cuda", tracker.current_bytes() + 4096)
try:
    torch.empty(8192, dtype=torch.uint8, device="cuda")
    out["oom"] = None
except torch.OutOfMemoryError as exc:
    out["oom"] = str(exc)
finally:
    set_memory_limit("cuda", 0)

tracker.stop()
out["summary"] = tracker.summary()
print("MEMWORKER " + json.dumps(out))
