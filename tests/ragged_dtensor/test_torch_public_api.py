"""torch's own public DTensor API with RaggedShard placements, as with ``Shard(0)``:
``torch.distributed.tensor.distribute_tensor``, ``DTensor.from_local(..., shape=, stride=)``,
``full_tensor()`` and ``redistribute()``, at world sizes 2 and 3 with a rank of zero units and
on a 2-D ``(Replicate(), RaggedShard)`` mesh, against the one-process tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ragged_dtensor import RaggedShard
from tests.harness import device_mesh

UNITS = {2: (3, 0), 3: (1, 0, 2)}


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) - 5.0


def public_api_case(units: tuple[int, ...], mesh_shape: tuple[int, ...]) -> None:
    mesh = device_mesh(*mesh_shape)
    ragged_dim = len(mesh_shape) - 1
    coordinate = mesh.get_local_rank(ragged_dim)
    placement = RaggedShard((0,), units)
    stand_ins = [Replicate()] * ragged_dim
    full = _full((6, 4))
    start, end = placement.flat_range(full.shape, coordinate)
    run = full.reshape(-1)[start:end]

    leaf = full.clone().requires_grad_()
    dt = distribute_tensor(leaf, mesh, [*stand_ins, placement])
    shard = distribute_tensor(leaf, mesh, [*stand_ins, Shard(0)])
    assert dt.placements == (*stand_ins, placement) and dt.shape == full.shape
    assert dt.stride() == full.stride() and dt.is_leaf and dt.requires_grad
    assert torch.equal(dt.to_local(), run)
    assert torch.equal(dt.full_tensor(), full) and torch.equal(shard.full_tensor(), full)

    # gradients flow as for Shard(0)
    (dt * dt).sum().backward()
    (shard * shard).sum().backward()
    assert dt.grad.placements == dt.placements
    assert torch.equal(dt.grad.full_tensor(), 2 * full)
    assert torch.equal(shard.grad.full_tensor(), 2 * full)

    # from_local with the global shape and stride, then every public redistribution
    again = DTensor.from_local(run.clone(), mesh, [*stand_ins, placement], shape=full.shape,
                               stride=full.stride())
    assert torch.equal(again.full_tensor(), full)
    as_shard = again.redistribute(mesh, [*stand_ins, Shard(0)])
    assert torch.equal(as_shard.to_local(), shard.to_local().detach())
    back = as_shard.redistribute(mesh, [*stand_ins, placement])
    assert torch.equal(back.to_local(), run)
    replicated = again.redistribute(mesh, [Replicate()] * len(mesh_shape))
    assert torch.equal(replicated.to_local(), full)
    other = RaggedShard((0,), tuple(reversed(units)))
    moved = again.redistribute(mesh, [*stand_ins, other])
    o_start, o_end = other.flat_range(full.shape, coordinate)
    assert torch.equal(moved.to_local(), full.reshape(-1)[o_start:o_end])

    # src_data_rank: rank 0's tensor is the truth, as for Shard(0)
    mine = full + dist.get_rank()
    assert torch.equal(distribute_tensor(mine, mesh, [*stand_ins, placement]).full_tensor(), full)
    assert torch.equal(distribute_tensor(mine, mesh, [*stand_ins, placement],
                                         src_data_rank=None).to_local(),
                       mine.reshape(-1)[start:end])
    # a DTensor already so placed comes back as it is; torch's own errors otherwise
    assert distribute_tensor(dt, mesh, dt.placements) is dt
    errors = []
    for bad in (lambda: distribute_tensor(leaf * 2, mesh, [*stand_ins, placement]),
                lambda: distribute_tensor(dt, mesh, [*stand_ins, Shard(0)]),
                lambda: distribute_tensor(full, mesh, [placement, *stand_ins, Replicate()])):
        with pytest.raises((RuntimeError, ValueError)) as error:
            bad()
        errors.append(type(error.value).__name__)
    shard_errors = []
    for bad in (lambda: distribute_tensor(leaf * 2, mesh, [*stand_ins, Shard(0)]),
                lambda: distribute_tensor(shard, mesh, [*stand_ins, placement]),
                lambda: distribute_tensor(full, mesh, [Shard(0), *stand_ins, Replicate()])):
        with pytest.raises((RuntimeError, ValueError)) as error:
            bad()
        shard_errors.append(type(error.value).__name__)
    assert errors == shard_errors == ["RuntimeError", "ValueError", "ValueError"]


@pytest.mark.parametrize("world", [2, 3])
def test_public_api_1d(ranks, world: int) -> None:
    ranks.run(world, public_api_case, UNITS[world], (world,))


def test_public_api_hsdp_mesh(ranks) -> None:
    ranks.run(4, public_api_case, (3, 0), (2, 2))
