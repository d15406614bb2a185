"""One scheduling-unit boundary per training iteration, however many torch optimizers step in
it: Megatron's chained optimizers step a dense and an expert optimizer an iteration, with the
distributed optimizer's parameter all-gathers between them."""

import gc

import torch

from nccl_ext.frontend.install import install_step_marker


def test_one_boundary_an_iteration_after_the_lead_optimizers_step():
    dense, expert = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    a, b = torch.optim.SGD(dense.parameters(), lr=0.1), torch.optim.SGD(expert.parameters(), lr=0.1)
    events = []
    handle = install_step_marker(lambda: events.append("boundary"))
    try:
        for it in range(3):
            a.step()
            events.append(f"a{it}")  # what the iteration does after the lead's step
            b.step()
            events.append(f"b{it}")
        assert events == ["boundary", "a0", "b0", "boundary", "a1", "b1", "boundary", "a2", "b2"]
        events.clear()
        del a  # a new optimizer (a restart of the training loop) leads once the old one is gone
        gc.collect()
        b.step()
        b.step()
        assert events == ["boundary", "boundary"]
    finally:
        handle.remove()
