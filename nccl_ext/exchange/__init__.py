"""The capture exchange's mechanisms: shared-memory arenas, CUDA IPC buffers, GPU reductions, device flags."""
