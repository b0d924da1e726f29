"""The sharded gradient DTensors DBuffer hands out are owned by reference, as FSDP2's are: they
wrap DBuffer's own views (no alias), stay valid and keep their values after
``free_sharded_grad`` (which only drops DBuffer's reference), and their memory is released as
soon as the last holder lets go (``zero_grad(set_to_none=True)``), so no gradient memory
outlives the gradients."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from layout_planner import Plan, TensorSpec, plan

from dbuffer import DBuffer
from tests.dbuffer.cases import full_tensors, grad_sum, local_piece, rank_grads


def zero_unit_plan(world_size: int) -> Plan:
    """``a`` lives on rank 0 only (one unit), ``b`` spans the others: zero-unit ranks for both."""
    p = plan([TensorSpec("a", 12, unit=12, shape=(3, 4)), TensorSpec("b", 10, shape=(2, 5))],
             world_size)
    assert any(p.local_range(n, r) == (0, 0) for n in ("a", "b") for r in range(world_size))
    return p


def _sharded_grads_owned_by_reference(p: Plan) -> bool:
    rank = dist.get_rank()
    buf = DBuffer.from_tensors(full_tensors(p, 0), p)
    for step in range(2):
        for n in buf.names:
            buf.grad_view(n).copy_(rank_grads(p, step, rank)[n])
        buf.reduce_scatter("sum")
        flat = weakref.ref(buf.sharded_grad_buffer)
        grads = {n: buf.sharded_grad(n) for n in buf.names}
        reference = grad_sum(p, step, dist.get_world_size())
        params = {n: torch.nn.Parameter(buf.sharded_param(n)) for n in buf.names}
        for n, g in grads.items():
            # the DTensor holds DBuffer's own view (no alias)
            assert g._local_tensor is buf.sharded_grad_view(n)
            assert buf.sharded_param(n)._local_tensor is buf.local_view(n)
            params[n].grad = g
        buf.free_sharded_grad()
        buf.free_grad()
        del grads, g
        for n, param in params.items():
            # still the reduced values: an optimizer step after the buffer let go is correct
            assert torch.equal(param.grad.to_local(), local_piece(p, n, rank, reference[n]))
            assert torch.equal(param.grad.full_tensor(), reference[n])
        optimizer = torch.optim.SGD(list(params.values()), lr=0.5)
        optimizer.step()
        assert flat() is not None
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        assert flat() is None, "zero_grad(set_to_none=True) must release the sharded gradients"
        for n in buf.names:
            expected = full_tensors(p, 0)[n] - 0.5 * sum(
                grad_sum(p, s, dist.get_world_size())[n] for s in range(step + 1))
            torch.testing.assert_close(buf.sharded_param(n).full_tensor(), expected)
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_sharded_grads_are_owned_by_reference(ranks, world_size: int) -> None:
    assert ranks.run(world_size, _sharded_grads_owned_by_reference, zero_unit_plan(world_size)) == \
        [True] * world_size
