"""PrismLLM's communication layer: what torch.distributed sees of the logical world, and the
transports that complete every op in capture and in emulation. It never imports megatron-core,
deepspeed or ``prism_launch``.

Folders, top to bottom (each imports only from the folders below it; ``capture`` and
``replay`` never import each other; checked by the import-linter contracts in
``pyproject.toml``):

- ``frontend/`` — what torch sees: the prism process group (:mod:`.frontend.process_group`),
  its installation under ``init_process_group`` / ``new_group`` (:mod:`.frontend.install`), the
  roots of object collectives a folded capture does not run (:mod:`.frontend.object_roots`).
- ``capture/`` — a captured rank's transport to the coordinator (:mod:`.capture.transport`), its
  side of the shared-memory exchange (:mod:`.capture.rank_exchange`), waits deferred to the GPU
  (:mod:`.capture.deferred_waits`), group discovery (:mod:`.capture.discover`).
- ``replay/`` — a sandbox rank's transport in emulation (:mod:`.replay.transport`): the recording
  it reads, live contributions between sandbox peers (:mod:`.replay.sandbox_peers`), divergence
  checks and their kinds, ``payload=none`` completion, the assistant hosting virtual ranks.
- ``exchange/`` — the capture exchange's mechanisms: host arenas in shared memory
  (:mod:`.exchange.arena`), CUDA IPC buffers (:mod:`.exchange.ipc`), reductions on the GPU
  (:mod:`.exchange.device_reduce`), flags a stream waits on (:mod:`.exchange.device_flags`).
- ``pruning/`` — pruned rings with compensation between sandbox ranks and the assistant.
- ``device_path/`` — emulation's device data path: host tier, prefetch stager, device pool,
  on-device compensation and checks.
- ``core/`` — collective semantics (:mod:`.core.ops`), the call (:mod:`.core.call`), groups,
  pending ops and their deadlines, the wire format, writing results, helper threads, spans,
  synthesized results, the arithmetic of stand-in replicas (:mod:`.core.mirrored`,
  :mod:`.core.replica_sums`), the device-memory ledger, errors.
"""
