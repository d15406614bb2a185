"""The device data path of emulation: tensor prefetching and on-device compensation.

A collective whose only live member is this sandbox rank (every other member virtual) —
and a send or receive with a virtual peer — never leaves the sandbox's device:

* **Prefetch.** The path plans what each op needs from its virtual peers (:mod:`.plan`) — the
  pieces of their recorded contributions the sandbox's result is made of, a folded group's
  recorded result, a virtual sender's payload — and stages it into a bounded device **pool**
  (:mod:`.pool`: rings of device memory, FIFO like the ops) from pinned host memory (the
  host tier, :mod:`.host_tier`) ahead of the op, by the prefetch mode (:mod:`.stager`:
  ``stream``, ``inline``, ``off``, ``preload``). On CUDA, with ``grow``, the streaming modes do
  what preload does when the device can spare the run's data (:func:`split_pool`).
* **Compensation on device.** Reductions fold the staged recorded terms and the live tensor
  in group-rank order into pool scratch (:mod:`.compensation`), bit-identical to the capture;
  gathers and all-to-alls just take the staged pieces.
* **Divergence checks without a host copy** (:mod:`.checks`): each live contribution's 32-bit
  word sum is taken on the device and compared at the step boundary with the same sum of the
  recorded tensors.

Nothing here allocates through torch's allocator during the run: the pool is allocated once
and its size is published (:func:`pool_bytes`) so memory accounting leaves it out, and any
memory cap of the target GPU (``DevicePath(memory_limit_bytes=...)``) is widened by it.

The same code runs on CPU (the "device" is host memory, copies are synchronous), which is how
it is tested where no GPU exists. :class:`DevicePath` (:mod:`.path`) puts the parts together.
"""

from nccl_ext.device_path.checks import word_sum
from nccl_ext.device_path.compensation import needed_pieces, result_of
from nccl_ext.device_path.path import DevicePath
from nccl_ext.device_path.plan import StagedOp, eligible
from nccl_ext.device_path.pool import charged_size, pool_bytes, split_pool
from nccl_ext.device_path.stats import PrefetchMode, PrefetchStats

__all__ = ["DevicePath", "PrefetchMode", "PrefetchStats", "StagedOp", "charged_size", "eligible", "needed_pieces",
           "pool_bytes", "result_of", "split_pool", "word_sum"]
