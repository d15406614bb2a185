"""``ReduceOp.PREMUL_SUM(f)`` (FSDP2's gradient division when its divide factor is not the
group size, e.g. torchtitan's ``set_gradient_divide_factor(1.0)``) reaches the prism process
group as a SUM of every input multiplied by ``f``, as NCCL computes it; the caller's tensors
are left unchanged and the results land in the caller's outputs."""

import pytest
import torch
import torch.distributed as dist

from nccl_ext.core.ops import ReduceKind, premul_factor, reduce_inputs
from nccl_ext.frontend.process_group import PrismProcessGroup


class _Opts:
    def __init__(self, op):
        self.reduceOp = op


@pytest.mark.parametrize("factor", [0.5, torch.tensor([0.5])])
def test_premul_sum_is_a_sum_of_premultiplied_copies(factor):
    x = torch.tensor([1.0, 3.0])
    kind, out = reduce_inputs(_Opts(dist.ReduceOp.PREMUL_SUM(factor)), [x])
    assert kind is ReduceKind.SUM
    assert out[0].tolist() == [0.5, 1.5] and out[0].dtype == x.dtype
    assert x.tolist() == [1.0, 3.0]  # the caller's input is untouched


def test_other_ops_contribute_the_tensors_themselves():
    x = torch.ones(2)
    kind, out = reduce_inputs(_Opts(dist.ReduceOp.AVG), [x])
    assert kind is ReduceKind.AVG and out[0] is x
    kind, out = reduce_inputs(None, [x])
    assert kind is ReduceKind.SUM and out[0] is x
    assert premul_factor(dist.ReduceOp.SUM) is None and premul_factor(dist.ReduceOp.PREMUL_SUM(2.0)) == 2.0


class _Group:
    """Just what the process group's collective entry points use: the group size and the
    submission, which here records the call and answers it at once."""

    def __init__(self, n):
        self.n, self.calls = n, []

    def _group_size(self):
        return self.n

    def _submit(self, call, apply, opts):
        self.calls.append(call)
        n = len(call.outputs) if getattr(call, "outputs", None) else len(call.tensors)
        apply([t.clone() for t in call.tensors[:n]])  # a stand-in result: this rank's first contributions
        return None


def test_reduce_scatter_and_all_reduce_submit_premultiplied_sums():
    g = _Group(2)
    inp, out = torch.tensor([2.0, 4.0]), torch.zeros(1)
    PrismProcessGroup._reduce_scatter_tensors(g, "reduce_scatter_single", [out], [inp],
                                              _Opts(dist.ReduceOp.PREMUL_SUM(0.25)))
    call = g.calls[-1]
    assert call.reduce is ReduceKind.SUM and [t.tolist() for t in call.tensors] == [[0.5], [1.0]]
    assert inp.tolist() == [2.0, 4.0] and out.tolist() == [0.5]
    t = torch.tensor([8.0])
    PrismProcessGroup._all_reduce(g, "allreduce", [t], _Opts(dist.ReduceOp.PREMUL_SUM(0.5)))
    assert g.calls[-1].reduce is ReduceKind.SUM and g.calls[-1].tensors[0].tolist() == [4.0]
    assert t.tolist() == [4.0]  # the result was copied into the caller's tensor


class _StateOnly:
    """A ReduceOp as torch before 2.12 hands it back from collective options: no ``factor``
    attribute, only its pickled state."""

    def __init__(self, state):
        self.op = dist.ReduceOp.RedOpType.PREMUL_SUM
        self._state = state

    def __getstate__(self):
        return self._state


@pytest.mark.parametrize("factor", [0.125, torch.tensor([0.5]), [torch.tensor([0.5])]])
def test_premul_factor_read_from_the_pickled_state(factor):
    got = premul_factor(_StateOnly((dist.ReduceOp.RedOpType.PREMUL_SUM, factor)))
    want = factor[0] if isinstance(factor, list) else factor
    assert got is want


def test_premul_sum_without_a_factor_in_its_state_is_refused():
    with pytest.raises(NotImplementedError, match="PREMUL_SUM without its factor"):
        premul_factor(_StateOnly((dist.ReduceOp.RedOpType.PREMUL_SUM, None)))
