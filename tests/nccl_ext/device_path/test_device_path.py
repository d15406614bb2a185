"""The device data path: results equal the capture's fold bit for bit for every collective,
member position and reduce op; the prefetch pool stages in trace order within its bound;
checks catch a changed contribution; a program that stops early is told."""

import threading
import time

import pytest
import torch

from nccl_ext.device_path import DevicePath, charged_size, needed_pieces, result_of, split_pool, word_sum
from nccl_ext.device_path import checks, host_tier, plan, pool
from nccl_ext.device_path.pool import Ring
from nccl_ext.core.ops import Collective, ReduceKind, compute
from nccl_ext.replay.transport import RecordedOp

KINDS = [Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER,
         Collective.GATHER, Collective.ALL_TO_ALL, Collective.BROADCAST, Collective.SCATTER, Collective.BARRIER]


def _contributions(kind: Collective, n: int, dtype, gen) -> list[list[torch.Tensor]]:
    pieces = {Collective.REDUCE_SCATTER: 2 * n, Collective.ALL_TO_ALL: n, Collective.SCATTER: n,
              Collective.GATHER: 1, Collective.BARRIER: 0}.get(kind, 2)
    out = []
    for _ in range(n):
        ts = [(torch.randn(5, 300, generator=gen) * 1e3).to(dtype) for _ in range(pieces)]
        out.append(ts)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_result_matches_the_capture_fold_bit_for_bit(kind, n, dtype):
    gen = torch.Generator().manual_seed(n)
    contribs = _contributions(kind, n, dtype, gen)
    reduces = [ReduceKind.SUM, ReduceKind.AVG, ReduceKind.MAX, ReduceKind.PRODUCT] \
        if kind in (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER) else [None]
    root = 1 if kind in (Collective.REDUCE, Collective.BROADCAST, Collective.GATHER, Collective.SCATTER) else None
    for reduce in reduces:
        expected = compute(kind, [c if kind is not Collective.BARRIER else None for c in contribs],
                           reduce=reduce, root=root)
        for me in sorted({0, 1, n // 2, n - 1}):
            terms = {m: {i: contribs[m][i] for i in needed_pieces(kind, n, me, root, m, len(contribs[m]))}
                     for m in range(n) if m != me}
            if kind is Collective.REDUCE_SCATTER:
                scratch = [torch.empty_like(contribs[me][i * n + me]) for i in range(len(contribs[me]) // n)]
            elif kind is Collective.ALL_REDUCE or (kind is Collective.REDUCE and me == root):
                scratch = [torch.empty_like(t) for t in contribs[me]]
            else:
                scratch = []
            got = result_of(kind, n, me, root, contribs[me], terms, scratch, reduce)
            assert len(got) == len(expected[me]), (kind, me)
            for a, b in zip(got, expected[me]):
                assert a.dtype == b.dtype and torch.equal(a, b), (kind, reduce, n, me)


def test_only_needed_pieces_are_staged():
    assert needed_pieces(Collective.ALL_TO_ALL, 4, 2, None, 0, 4) == [2]
    assert needed_pieces(Collective.REDUCE_SCATTER, 4, 1, None, 3, 8) == [1, 5]
    assert needed_pieces(Collective.BROADCAST, 4, 1, 2, 0, 3) == []
    assert needed_pieces(Collective.BROADCAST, 4, 1, 2, 2, 3) == [0, 1, 2]
    assert needed_pieces(Collective.REDUCE, 4, 1, 2, 0, 1) == []
    assert needed_pieces(Collective.SCATTER, 4, 3, 0, 0, 4) == [3]


def test_ring_is_fifo_and_bounded():
    ring = Ring(1000)
    a, b = ring.alloc(400), ring.alloc(400)
    assert a == (0, 400) and b == (400, 800)
    assert ring.alloc(300) is None  # 200 left at the end, the start is taken
    ring.release(a)
    c = ring.alloc(300)
    assert c == (0, 300)  # wrapped
    assert ring.alloc(150) is None  # 100 left before b's start
    assert ring.used() == 700
    ring.release(b)
    ring.release(c)
    assert ring.used() == 0 and ring.alloc(1000) == (0, 1000)
    with pytest.raises(ValueError):
        ring.alloc(1001)


@pytest.mark.parametrize("t", [torch.arange(10, dtype=torch.int32) * 7_000_000_000 // 7,
                               torch.randn(7, dtype=torch.float32), torch.randn(5, dtype=torch.float32).bfloat16(),
                               torch.tensor([True, False, True]), torch.full((9,), -1, dtype=torch.int8)])
def test_word_sum_matches_the_device_side_sum(t):
    w = checks.as_words(t)
    slot = torch.zeros((), dtype=torch.int32)
    if w.dtype == torch.int32:
        torch.sum(w, dim=0, dtype=torch.int32, out=slot)
    else:
        slot.copy_(w.to(torch.int64).sum())
    assert int(slot) & 0xFFFFFFFF == word_sum(t)
    changed = t.clone()
    changed.view(-1)[0] = changed.view(-1)[1] if t.numel() > 1 and changed.view(-1)[0] != changed.view(-1)[1] else 0
    if not torch.equal(changed, t):
        assert word_sum(changed) != word_sum(t)


class _Recording:
    """Rank 0 (the sandbox) all-reduces a 1 KiB tensor with virtual rank 1, ``ops`` times."""

    def __init__(self, ops: int, size: int = 256):
        self.size = size
        self.data = {(r, s): torch.full((size,), float(r * 1000 + s)) for r in (0, 1) for s in range(ops)}
        self.ops = [(self._op(0, s), 0, s, -1, 0) for s in range(ops)]
        self.reads = 0

    def _op(self, rank, seq):
        return RecordedOp(op="allreduce", unit=0, t_start=0.0, t_end=0.0, n_tensors=1, shapes=((self.size,),),
                          dtypes=("float32",), idx=seq, kind="all_reduce")

    def ops_of(self, rank):
        return self.ops

    def group_ranks(self, gid):
        return (0, 1)

    def folded(self, gid):
        return False

    def collective(self, rank, gid, seq):
        return self._op(rank, seq)

    def piece(self, rank, gid, seq, i):
        self.reads += 1
        return self.data[(rank, seq)]


def _dp(rec, **kw) -> DevicePath:
    return DevicePath(rank=0, sandbox=(0,), recording=rec, **kw)


def _take_and_fold(dp: DevicePath, rec: _Recording, s: int) -> None:
    """Take op ``s``, check the sandbox's unchanged contribution and fold it with the staged
    peer: the result must be the exact sum."""
    staged = dp.take(s, f"op {s}")
    live = rec.data[(0, s)].clone()
    dp.verify([live], staged.refs, ("allreduce", s))
    out = result_of(Collective.ALL_REDUCE, 2, 0, None, [live], staged.terms, staged.scratch, ReduceKind.SUM)
    assert torch.equal(out[0], live + rec.data[(1, s)])


@pytest.mark.parametrize("mode", ["stream", "off", "preload"])
def test_every_op_gets_its_own_data_in_order(mode):
    rec = _Recording(40)
    dp = _dp(rec, mode=mode, pool_bytes=4096)  # room for a few ops only (2 KiB each with scratch)
    for s in range(40):
        _take_and_fold(dp, rec, s)
    assert dp.flush() == []
    assert dp.close() == (0, None)
    st = dp.stats
    assert st.staged_ops == 40 and st.checks == 40
    if mode == "stream":
        assert st.high_water_bytes <= st.pool_bytes and st.hits + st.stalls + st.in_flight == 40
    if mode == "off":
        assert st.stalls == 40
    if mode == "preload":
        assert st.hits == 40 and st.pool_bytes >= 40 * 2048


def test_stream_mode_stages_ahead_but_never_beyond_the_pool():
    rec = _Recording(30)
    dp = _dp(rec, mode="stream", pool_bytes=8192)  # the ring holds 4 ops of 2 KiB
    dp.take(0, "op 0")
    deadline = threading.Event()
    for _ in range(100):
        if dp.stats.staged_ops >= 4:
            break
        deadline.wait(0.02)
    assert dp.stats.staged_ops == 4  # ahead of the program, bounded by the pool
    for s in range(1, 30):
        dp.take(s, f"op {s}")
    assert dp.close() == (0, None)
    assert dp.stats.staged_ops == 30


def test_a_changed_contribution_is_caught_at_the_flush():
    rec = _Recording(3)
    dp = _dp(rec, mode="stream")
    for s in range(3):
        staged = dp.take(s, f"op {s}")
        live = rec.data[(0, s)].clone()
        if s == 1:
            live[3] += 1
        dp.verify([live], staged.refs, ("allreduce", s))
    assert [w for w, *_ in dp.flush()] == [("allreduce", 1)]
    dp.close()


def test_a_program_that_stops_early_is_told_and_out_of_order_ops_refused():
    rec = _Recording(10)
    dp = _dp(rec, mode="stream")
    dp.take(0, "op 0")
    dp.take(3, "op 3")  # ops 1-2 never entered: their space is given back
    with pytest.raises(RuntimeError, match="not in the trace's order"):
        dp.take(2, "op 2")
    assert dp.close() == (6, 4)
    never = _dp(_Recording(5), mode="off")
    assert never.close() == (5, 0)


def test_chunked_parallel_word_sum_equals_the_plain_one():
    dp = _dp(_Recording(1), workers=3)
    t = torch.randn(5 * checks.CHUNK_WORDS + 7)
    assert dp._word_sum(t) == word_sum(t)
    dst = torch.empty_like(t)
    dp._parallel(host_tier.chunks(dst, t), lambda a, b: a.copy_(b))
    assert torch.equal(dst, t)
    dp.close()


@pytest.mark.parametrize("mode", ["stream", "preload"])
def test_host_tier_is_filled_ahead_and_feeds_every_op(mode):
    rec = _Recording(25)
    dp = _dp(rec, mode=mode, pool_bytes=4096, tier_on_host=True)
    for s in range(25):
        staged = dp.take(s, f"op {s}")
        live = rec.data[(0, s)].clone()
        if s == 7:
            live[0] = -1.0
        dp.verify([live], staged.refs, ("allreduce", s))
        out = result_of(Collective.ALL_REDUCE, 2, 0, None, [live], staged.terms, staged.scratch, ReduceKind.SUM)
        assert torch.equal(out[0], live + rec.data[(1, s)])
    assert [w for w, *_ in dp.flush()] == [("allreduce", 7)]
    assert dp.stats.host_tier_bytes == 25 * 1024  # the peer's 1 KiB per op, nothing else
    assert dp.close() == (0, None)


def test_host_tier_is_skipped_beyond_its_bound():
    dp = _dp(_Recording(10), mode="stream", tier_on_host=True, host_tier_bytes=4096)
    for s in range(10):
        dp.take(s, f"op {s}")
    assert dp.stats.host_tier_bytes == 0 and dp.close() == (0, None)


def test_prepare_fills_the_host_tier_before_the_first_op():
    rec = _Recording(20)
    dp = _dp(rec, mode="stream", pool_bytes=8192, tier_on_host=True)
    dp.prepare()
    dp._prep.join(timeout=10)
    assert not dp._prep.is_alive() and dp.device is None  # all read, nothing on the "device" yet
    reads = rec.reads
    assert reads == 20 * 2  # the peer's piece to stage and the own piece's word sum, once per op
    for s in range(20):
        _take_and_fold(dp, rec, s)
    assert rec.reads == reads  # the steps never touched the trace
    assert dp.flush() == [] and dp.close() == (0, None)
    assert dp.stats.host_tier_bytes == 20 * 1024 and dp.stats.staged_ops == 20
    assert dp.stats.copies < 20  # ops back to back in the pool moved together


def test_a_prepared_path_that_never_starts_reports_every_op():
    dp = _dp(_Recording(6), mode="stream", tier_on_host=True)
    dp.prepare()
    assert dp.close() == (6, 0)


def test_stager_refills_in_batches_once_the_pool_is_full():
    rec = _Recording(40)
    dp = _dp(rec, mode="stream", pool_bytes=16384)  # 8 ops of 2 KiB; refill below 6 ops' worth
    dp.take(0, "op 0")
    for _ in range(200):
        if dp.stats.staged_ops >= 8:
            break
        threading.Event().wait(0.01)
    assert dp.stats.staged_ops == 8
    dp.take(1, "op 1")  # frees op 0's space: a quarter of the pool is not free yet
    threading.Event().wait(0.2)
    assert dp.stats.staged_ops == 8
    dp.take(2, "op 2")  # a quarter free (ops 0-1): it refills that space
    for _ in range(200):
        if dp.stats.staged_ops >= 10:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)
    assert dp.stats.staged_ops == 10
    dp.take(3, "op 3")  # one op's space free: below the mark again, it holds off
    threading.Event().wait(0.2)
    assert dp.stats.staged_ops == 10
    dp.take(4, "op 4")  # a quarter free (ops 2-3): the next batch
    for _ in range(200):
        if dp.stats.staged_ops >= 12:
            break
        threading.Event().wait(0.01)
    assert dp.stats.staged_ops == 12
    for s in range(5, 40):
        dp.take(s, f"op {s}")
    assert dp.close() == (0, None) and dp.stats.staged_ops == 40


def test_ring_fits_agrees_with_alloc():
    ring = Ring(1000)
    a = ring.alloc(600)
    assert ring.fits(400) and not ring.fits(401)
    ring.alloc(400)
    assert not ring.fits(1)
    ring.release(a)
    assert ring.fits(600) and not ring.fits(601) and ring.used() == 400


def _plans(n: int, staged: int, scratch: int) -> list:
    item = plan.Item((staged // 4,), torch.float32, lambda: None)
    return [plan.Plan(i, {1: {0: item}}, [], [((scratch // 4,), torch.float32)], []) for i in range(n)]


def test_a_device_pool_is_sized_in_whole_allocator_segments():
    # pools measured on an H200 whose charge exceeded their size: a grown dense pool of
    # 7,419,434,496 B was charged 289,280 B more (its segment's tail was under 1 MiB), a
    # 536,887,552 B pool 256 B more (512 B rounding); the program's peak moved by as much
    for asked in (7_419_434_496, 536_887_552, 9_089_095_168, 1, 2 << 20, (2 << 20) + 1):
        got = charged_size(asked)
        assert got >= asked and got % (2 << 20) == 0 and got - asked < 2 << 20
    assert charged_size(7_419_434_496) - 7_419_434_496 == 289_280
    assert charged_size(2 << 20) == 2 << 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_pool_is_charged_exactly_what_is_left_out_of_the_programs_memory():
    from nccl_ext.device_path import pool_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        for asked in (7_419_434_496 >> 4, 536_887_552):
            path = DevicePath(rank=0, sandbox=(0,), recording=None, mode="off", device_kind="cuda")
            path.device, path._cuda = device, True
            before = torch.cuda.memory_allocated()
            path._allocate(asked)
            assert torch.cuda.memory_allocated() - before == pool_bytes(device) >= asked
            del path._pool
    finally:
        pool._POOL_BYTES.pop(str(device), None)  # no pool left for later tests' memory figures


def test_split_pool_grows_to_the_whole_run_only_when_it_is_spare():
    plans = _plans(100, 1 << 20, 1 << 18)  # 100 MiB staged, 25 MiB scratch
    whole = 100 * (1 << 20) + 100 * (1 << 18)
    data, work, grown = split_pool("stream", plans, 16 << 20, None)
    assert not grown and abs(data + work - (16 << 20)) <= 1024 and data >= 2 << 20 and work >= 2 << 18
    assert split_pool("stream", plans, 16 << 20, whole - 1) == (data, work, False)  # does not fit
    assert split_pool("stream", plans, 16 << 20, whole) == (100 << 20, 25 << 20, True)
    assert split_pool("stream", plans, 1 << 30, 1 << 40)[2] is False  # the asked pool holds it all already
    assert split_pool("preload", plans, 16 << 20, None) == (100 << 20, 25 << 20, False)
    assert split_pool("off", plans, 16 << 20, 1 << 40) == (data, work, False)


def test_a_grown_pool_is_filled_before_the_first_op_is_handed_over(monkeypatch):
    rec = _Recording(30)
    monkeypatch.setattr(DevicePath, "_spare_bytes", lambda self: 1 << 30)
    dp = _dp(rec, mode="stream", pool_bytes=8192, tier_on_host=True, grow=True)  # 8 KiB would hold 4 ops
    dp.take(0, "op 0")
    assert dp.stats.pool_grown and dp.stats.pool_bytes >= 30 * 2048
    assert dp.stats.staged_ops == 30 and dp._thread is None  # all of it, no stager left to run beside the program
    for s in range(1, 30):
        _take_and_fold(dp, rec, s)
    assert dp.flush() == [] and dp.close() == (0, None)
    assert dp.stats.hits == 30 and dp.stats.stalls == dp.stats.in_flight == 0 and dp.stats.preload_s > 0


def test_without_spare_memory_or_a_captured_peak_the_pool_stays_as_asked(monkeypatch):
    monkeypatch.setattr(DevicePath, "_spare_bytes", lambda self: 4096)
    dp = _dp(_Recording(30), mode="stream", pool_bytes=8192, tier_on_host=True, grow=True)
    for s in range(30):
        dp.take(s, f"op {s}")
    assert not dp.stats.pool_grown and dp.stats.pool_bytes < 30 * 2048 and dp.close() == (0, None)
    monkeypatch.undo()
    dp = _dp(_Recording(3), mode="stream", grow=True, expected_peak=None)  # host pool: no CUDA memory to size
    assert dp._spare_bytes() is None


def test_host_tier_sums_large_own_pieces_in_parts_and_batches_small_ops():
    rec = _Recording(3, size=5_000_000)  # 20 MB contributions: summed in 8 MiB parts on the helper threads
    dp = _dp(rec, mode="stream", tier_on_host=True, workers=3, host_tier_bytes=1 << 30)
    dp.prepare()
    dp._prep.join(60)
    assert [p.refs for p in dp._planned] == [[word_sum(rec.data[(0, s)])] for s in range(3)]
    assert all(torch.equal(dp._tier[p.tier_at:p.tier_at + p.staged_nbytes].view(torch.float32), rec.data[(1, s)])
               for s, p in enumerate(dp._planned))
    assert dp.close() == (3, 0)  # never started: every op left


def test_inline_mode_stages_on_the_programs_thread_as_ops_are_entered():
    rec = _Recording(40)
    dp = _dp(rec, mode="inline", pool_bytes=8192, tier_on_host=True)  # room for a few ops of 2 KiB
    dp.prepare()
    dp._prep.join(30)  # the host tier is loaded: every later op is staged ahead
    for s in range(40):
        if s == 10:
            assert 10 < dp.stats.staged_ops < 20  # ahead of the 10 entered, as far as the pool holds
        staged = dp.take(s, f"op {s}")
        live = rec.data[(0, s)].clone()
        if s == 21:
            live[3] = 7.0
        dp.verify([live], staged.refs, ("allreduce", s))
        out = result_of(Collective.ALL_REDUCE, 2, 0, None, [live], staged.terms, staged.scratch, ReduceKind.SUM)
        assert torch.equal(out[0], live + rec.data[(1, s)])
    assert [w for w, *_ in dp.flush()] == [("allreduce", 21)]
    assert dp._thread is None and dp.close() == (0, None)
    st = dp.stats
    assert st.staged_ops == 40 and st.hits == 40 and st.stalls == st.in_flight == 0
    assert st.high_water_bytes <= st.pool_bytes


def test_inline_mode_skips_ops_the_program_never_enters_and_refuses_out_of_order_ones():
    rec = _Recording(20)
    dp = _dp(rec, mode="inline", pool_bytes=8192, tier_on_host=True)
    for s in (0, 1, 5, 6, 12):  # the loader may still be behind: staged at entry then
        _take_and_fold(dp, rec, s)
    with pytest.raises(RuntimeError, match="diverged"):
        dp.take(3, "op 3")
    assert dp.close() == (7, 13)  # 13..19 never entered


def test_inline_mode_refuses_an_op_off_the_trace_at_once_while_the_loader_lags():
    gate = threading.Event()

    class Slow(_Recording):
        def piece(self, rank, gid, seq, i):
            if seq >= 1:
                gate.wait(60)  # the host tier's loader stops at op 1
            return super().piece(rank, gid, seq, i)

    rec = Slow(6)
    dp = _dp(rec, mode="inline", pool_bytes=8192, tier_on_host=True, timeout_s=60)
    try:
        dp.take(0, "op 0")
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="diverged"):
            dp.take(0, "op 0 again")  # nothing staged, and op 1 is not loaded: nothing will stage it
        assert time.monotonic() - t0 < 5
    finally:
        gate.set()
        dp.close()


def test_inline_without_a_host_tier_falls_back_to_the_stager_thread():
    rec = _Recording(12)
    dp = _dp(rec, mode="inline", pool_bytes=8192, host_tier_bytes=4096)  # the run's data exceeds the tier
    for s in range(12):
        _take_and_fold(dp, rec, s)
    assert dp._thread is not None and dp.close() == (0, None) and dp.stats.staged_ops == 12


def test_a_stuck_host_tier_loader_fails_the_op_by_its_deadline():
    gate = threading.Event()

    class Stuck(_Recording):
        def piece(self, rank, gid, seq, i):
            gate.wait(60)
            return super().piece(rank, gid, seq, i)

    dp = _dp(Stuck(3), mode="inline", pool_bytes=8192, tier_on_host=True, timeout_s=1)
    try:
        with pytest.raises(RuntimeError, match=r"rank 0: op #0 was not loaded into the host tier within 1 s"):
            dp.take(0, "op 0")
    finally:
        gate.set()
        dp.close()


def test_spare_memory_leaves_room_for_the_program_the_reserve_the_sharers_and_the_target_cap(monkeypatch):
    g = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * g, 140 * g))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * g)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * g)
    dp = _dp(_Recording(1), grow=True, expected_peak=11 * g, reserve_bytes=4 * g, share=2)
    dp._cuda, dp.device = True, torch.device("cuda", 0)
    # the program will take 11 - 1 allocated - 1 cached = 9 GiB more (x1.25), then the reserve
    assert dp._spare_bytes() == (100 * g - 9 * g * 5 // 4 - 4 * g) // 2
    capped = _dp(_Recording(1), grow=True, expected_peak=11 * g, reserve_bytes=4 * g, share=2,
                 memory_limit_bytes=130 * g)  # the target's cap: cap + pool must fit the device
    capped._cuda, capped.device = True, torch.device("cuda", 0)
    assert capped._spare_bytes() == 10 * g
    dp.expected_peak = 200 * g  # more than the device has: nothing to spare
    assert dp._spare_bytes() == 0
    dp.expected_peak = None
    assert dp._spare_bytes() is None
