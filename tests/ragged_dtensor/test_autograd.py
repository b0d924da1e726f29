"""Gradients through from_local, full_tensor and redistribute with RaggedShard, against the
single-device gradient of the same loss: every loss is sum(y * W) for a fixed full tensor W, so
the reference gradient of the full input is W itself."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ragged_dtensor import RaggedShard, distribute_tensor, local_shaped
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import expected_local


def weights(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape) - 7


def ragged_leaf(full: torch.Tensor, placement: RaggedShard, mesh) -> tuple[torch.Tensor, DTensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    leaf = expected_local(full, placement, world, rank).clone().requires_grad_()
    dt = DTensor.from_local(leaf, mesh, [placement], shape=full.shape, stride=full.stride(),
                            run_check=False)
    return leaf, dt


def autograd_case(shape: tuple[int, ...], units: tuple[int, ...]) -> int:
    mesh = device_mesh(dist.get_world_size())
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    w = weights(shape)
    placement = RaggedShard((0,), units)
    want = expected_local(w, placement, world, rank)
    checks = 0

    # full_tensor: the backward of RaggedShard -> Replicate keeps this rank's slice of W
    leaf, dt = ragged_leaf(full, placement, mesh)
    (dt.full_tensor() * w).sum().backward()
    assert torch.equal(leaf.grad, want)
    checks += 1

    # redistribute to every other placement, loss on the local pieces
    one_hot = RaggedShard((0,), [int(r == world - 1) for r in range(world)])
    for target in (Shard(0), Shard(len(shape) - 1), one_hot, Replicate()):
        leaf, dt = ragged_leaf(full, placement, mesh)
        moved = dt.redistribute(mesh, [target])
        (moved.to_local() * expected_local(w, target, world, rank)).sum().backward()
        assert torch.equal(leaf.grad, want), target
        checks += 1

    # local_shaped is a differentiable view
    leaf, dt = ragged_leaf(full, placement, mesh)
    rows = local_shaped(dt)
    (rows * want.view(rows.shape)).sum().backward()
    assert torch.equal(leaf.grad, want)
    checks += 1

    # Replicate -> RaggedShard: the gradient of the replicated input is all of W
    rep = distribute_tensor(full.clone().requires_grad_(), mesh, [Replicate()])
    assert rep.is_leaf and rep.requires_grad
    rep.redistribute(mesh, [placement]).to_local().mul(want).sum().backward()
    assert rep.grad.placements == (Replicate(),) and torch.equal(rep.grad.to_local(), w)
    checks += 1

    # distribute_tensor gives a RaggedShard leaf that accumulates gradients
    param = distribute_tensor(full.clone().requires_grad_(), mesh, [placement])
    assert param.is_leaf and param.requires_grad
    (param.full_tensor() * w).sum().backward()
    assert param.grad.placements == (placement,) and torch.equal(param.grad.to_local(), want)
    checks += 1

    # Partial -> RaggedShard (reduce-scatter): every rank's partial input gets the gradient W
    leaf = full.clone().requires_grad_()
    pending = DTensor.from_local(leaf, mesh, [Partial()], run_check=False)
    pending.redistribute(mesh, [placement]).to_local().mul(want).sum().backward()
    assert torch.equal(leaf.grad, w)
    checks += 1
    return checks


def hsdp_autograd_case(shape: tuple[int, ...], units: tuple[int, ...]) -> int:
    mesh = device_mesh(2, 2)
    col = mesh.get_local_rank(1)
    full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    w = weights(shape)
    placement = RaggedShard((0,), units)
    leaf = expected_local(full, placement, 2, col).clone().requires_grad_()
    dt = DTensor.from_local(leaf, mesh, (Replicate(), placement), shape=full.shape,
                            stride=full.stride(), run_check=False)
    (dt.full_tensor() * w).sum().backward()
    assert torch.equal(leaf.grad, expected_local(w, placement, 2, col))
    return 1


def test_gradients_match_single_device(ranks) -> None:
    for world, shape, units in [(1, (5, 3), (1,)), (3, (12, 5), (2, 0, 1)), (4, (7, 2), (0, 0, 1, 0))]:
        assert ranks.run(world, autograd_case, shape, units) == [9] * world


def test_gradients_on_the_hsdp_layout(ranks) -> None:
    assert ranks.run(4, hsdp_autograd_case, (6, 4), (2, 1)) == [1] * 4
