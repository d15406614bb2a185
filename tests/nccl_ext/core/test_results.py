"""Results are written into the caller's tensors as a real backend's kernels write them: the
memory changes, autograd's version counter does not."""

import pytest
import torch

from nccl_ext.core.results import copy_pieces, no_grad_copy


def test_a_result_written_after_autograd_saved_the_tensor_leaves_backward_working():
    # Megatron broadcasts its attention mask within the tensor-parallel group; with the wait
    # passed on the GPU the result lands after the forward pass saved the mask for backward
    x = torch.ones(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    y = (x * mask).sum()  # saves ``mask`` at version 0
    no_grad_copy(mask, torch.full((2, 3), 2.0), "broadcast")
    assert mask._version == 0 and torch.equal(mask, torch.full((2, 3), 2.0))
    y.backward()  # a copy_ into ``mask`` itself raises "modified by an inplace operation"
    assert torch.equal(x.grad, mask)


@pytest.mark.parametrize("contiguous", [True, False])
def test_pieces_land_in_place_without_a_version_bump(contiguous):
    base = torch.zeros(4, 6)
    dst = base if contiguous else base.t()
    pieces = [torch.arange(12.0), torch.arange(12.0, 24.0)]
    copy_pieces(dst, pieces, "all_gather")
    assert dst._version == 0
    assert torch.equal(dst.reshape(-1), torch.arange(24.0))


def test_a_view_is_written_where_it_lies():
    whole = torch.zeros(10)
    part = whole[2:6]
    no_grad_copy(part, torch.ones(4), "recv")
    assert torch.equal(whole, torch.tensor([0, 0, 1, 1, 1, 1, 0, 0, 0, 0.0]))
