"""Large host copies and sums in slices on a thread pool (nccl_ext/core/sliced.py): the same bytes as
one pass, whatever the slicing; small or mismatched tensors take the plain path."""

import torch

from nccl_ext.core import sliced


def test_a_large_copy_is_the_same_bytes_as_one_pass():
    src = torch.randn(sliced.PARALLEL_MIN + 777)
    dst = torch.empty_like(src)
    sliced.copy(dst, src)
    assert torch.equal(dst, src)


def test_run_covers_every_element_once():
    seen = torch.zeros(sliced.PARALLEL_MIN * 2 + 3, dtype=torch.int32)
    sliced.run(seen.numel(), lambda a, b: seen[a:b].add_(1))
    assert int(seen.min()) == 1 and int(seen.max()) == 1
    small = torch.zeros(10, dtype=torch.int32)
    sliced.run(10, lambda a, b: small[a:b].add_(1))
    assert small.tolist() == [1] * 10


def test_mismatched_tensors_take_the_plain_copy():
    src = torch.arange(sliced.PARALLEL_MIN + 1, dtype=torch.float64)
    dst = torch.empty(sliced.PARALLEL_MIN + 1, dtype=torch.float32)
    sliced.copy(dst, src)  # a dtype conversion, as copy_ does it
    assert torch.equal(dst, src.float())


def test_a_forked_child_slices_on_a_pool_of_its_own():
    """The launcher forks ranks after its coordinator may have used the pool: the child's work
    must not be handed to the parent's workers (they do not exist in the child)."""
    import os

    sliced.run(sliced.PARALLEL_MIN, lambda a, b: None)  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: a large copy must finish
        try:
            src = torch.ones(sliced.PARALLEL_MIN * 2)
            dst = torch.zeros_like(src)
            sliced.copy(dst, src)
            os._exit(0 if bool(torch.equal(dst, src)) else 3)
        except BaseException:
            os._exit(4)
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's sliced copy did not finish within 30 s")
