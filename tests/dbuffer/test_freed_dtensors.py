"""The RaggedShard DTensors DBuffer hands out (sharded gradients, sharded parameters) are built
around DBuffer's own views, so the freed-buffer fence covers them: every use of a sharded
gradient DTensor, its local tensor and a stale ``p.grad`` raises ``FreedBufferError`` while
the sharded gradients are freed (before, the DTensor wrapped an unfenced alias and reading it
killed the process), and the same objects work again after the next reduce-scatter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from layout_planner import Plan, TensorSpec, plan

from dbuffer import DBuffer, FreedBufferError
from tests.dbuffer.cases import full_tensors, grad_sum, local_piece, rank_grads


def zero_unit_plan(world_size: int) -> Plan:
    """``a`` lives on rank 0 only (one unit), ``b`` spans the others: zero-unit ranks for both."""
    p = plan([TensorSpec("a", 12, unit=12, shape=(3, 4)), TensorSpec("b", 10, shape=(2, 5))],
             world_size)
    assert any(p.local_range(n, r) == (0, 0) for n in ("a", "b") for r in range(world_size))
    return p


def _uses(g: torch.Tensor, param: torch.nn.Parameter) -> list:
    """Reads and writes of a sharded gradient DTensor, its local tensor, and the optimizer
    path through a stale ``p.grad`` (``param.grad`` is ``g``)."""

    def stale_grad() -> None:
        torch.optim.SGD([param], lr=0.1).zero_grad(set_to_none=False)

    return [lambda: g.to_local().sum(), lambda: g.sum(), lambda: g + 1,
            lambda: g.full_tensor(), lambda: g.redistribute(g.device_mesh, g.placements),
            lambda: g.to_local().clone(), lambda: g.mul_(2), lambda: print(g),
            lambda: torch._foreach_norm([g]), stale_grad]


def _freed_sharded_grad_case(p: Plan) -> bool:
    rank = dist.get_rank()
    buf = DBuffer.from_tensors(full_tensors(p, 0), p)
    for step in range(2):
        for n in buf.names:
            buf.grad_view(n).copy_(rank_grads(p, step, rank)[n])
        buf.reduce_scatter("sum")
        grads = {n: buf.sharded_grad(n) for n in buf.names}
        reference = grad_sum(p, step, dist.get_world_size())
        for n, g in grads.items():
            # the DTensor holds DBuffer's own view (no alias), and is the same object each step
            assert g._local_tensor is buf.sharded_grad_view(n)
            assert buf.sharded_param(n)._local_tensor is buf.local_view(n)
            assert torch.equal(g.to_local(), local_piece(p, n, rank, reference[n]))
            assert torch.equal(g.full_tensor(), reference[n])
        params = {n: torch.nn.Parameter(buf.sharded_param(n)) for n in buf.names}
        for n, param in params.items():
            param.grad = grads[n]
        buf.free_sharded_grad()
        buf.free_grad()
        for n, g in grads.items():
            for use in _uses(g, params[n]):
                with pytest.raises(FreedBufferError, match=f"'{n}'.*sharded gradient buffer"):
                    use()
            assert g.shape == reference[n].shape  # metadata stays readable
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_freed_sharded_grad_dtensor_raises_on_every_use(ranks, world_size: int) -> None:
    assert ranks.run(world_size, _freed_sharded_grad_case, zero_unit_plan(world_size)) == \
        [True] * world_size
