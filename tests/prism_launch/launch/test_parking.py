"""Checkpoint parking policy (the driver API itself is exercised by bench/gpu_park.py on a GPU)."""

from prism_launch.launch.parking import CudaCheckpointParker, ParkingError


class FakeApi:
    def __init__(self, no_cuda=()):
        self.log: list[tuple[str, int]] = []
        self.no_cuda = set(no_cuda)

    def state(self, pid):
        if pid in self.no_cuda:
            raise ParkingError("no CUDA state")
        return 0

    def checkpoint(self, pid):
        self.log.append(("checkpoint", pid))

    def restore(self, pid):
        self.log.append(("restore", pid))


def cycle(parker, ranks, rounds):
    """Ranks blocked on one collective per round: each runs, then parks, in order."""
    for _ in range(rounds):
        for r in ranks:
            parker.resume(r, 100 + r, running=set())
            parker.parked(r, 100 + r)


def test_resident_budget_is_kept_and_cyclic_rounds_switch_once():
    api = FakeApi()
    p = CudaCheckpointParker(3, api)
    cycle(p, range(4), rounds=5)
    assert p.stats.max_resident == 3
    # most-recently-parked eviction: one checkpoint + one restore per round after the first
    assert p.stats.checkpoints <= 6 and p.stats.restores <= 5  # rounds + 1 (the first admission)
    assert p.stats.checkpoints - p.stats.restores in (0, 1)
    restored = [pid for what, pid in api.log if what == "restore"]
    checkpointed = [pid for what, pid in api.log if what == "checkpoint"]
    assert set(restored) <= set(checkpointed)


def test_lru_would_thrash_where_this_policy_does_not():
    p = CudaCheckpointParker(7, FakeApi())
    cycle(p, range(8), rounds=4)
    assert p.stats.checkpoints <= 5  # rounds + 1; LRU would checkpoint every rank every round


def test_process_without_cuda_state_is_not_checkpointed():
    api = FakeApi(no_cuda={100})
    p = CudaCheckpointParker(1, api)
    p.resume(0, 100, running=set())
    p.parked(0, 100)
    p.resume(1, 101, running=set())
    assert api.log == [] and p.stats.checkpoints == 0
