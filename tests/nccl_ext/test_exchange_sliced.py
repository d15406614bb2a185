"""Large host copies and sums in slices on a thread pool (nccl_ext/sliced.py): the same bytes as
one pass, whatever the slicing; small or mismatched tensors take the plain path."""

import torch

from nccl_ext import sliced


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
