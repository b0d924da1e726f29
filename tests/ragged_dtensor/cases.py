"""Helpers shared by the ragged_dtensor tests: random layouts and the reference local pieces.

Every expected local piece is computed here from the full tensor with plain slicing
(``torch.chunk`` for ``Shard``), independently of the library.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from ragged_dtensor import RaggedShard
from tests.harness import device_mesh


def random_units(rng: random.Random, world: int) -> list[int]:
    """Random ``local_units``: a quarter one-hot, the rest with zeros allowed (never all zero)."""
    kind = rng.random()
    if kind < 0.25:
        units = [0] * world
        units[rng.randrange(world)] = rng.randint(1, 3)
        return units
    units = [rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(world)]
    if sum(units) == 0:
        units[rng.randrange(world)] = 1
    return units


def ragged_slice(full: torch.Tensor, k: int, units: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat run of ``full`` under ``RaggedShard(range(k), units)`` (a view)."""
    rows_per_unit = math.prod(full.shape[:k]) // sum(units)
    per_unit = rows_per_unit * math.prod(full.shape[k:])
    start = sum(units[:rank]) * per_unit
    return full.reshape(-1)[start : start + units[rank] * per_unit]


def shard_slice(full: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``Shard(dim)`` block of ``full`` (``torch.chunk``, empty past the end)."""
    chunks = list(torch.chunk(full, world, dim)) if full.shape[dim] else []
    if rank < len(chunks):
        return chunks[rank]
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_empty(shape)


def expected_local(full: torch.Tensor, placement, world: int, rank: int) -> torch.Tensor:
    """The local tensor ``placement`` gives ``rank`` of ``world`` (Replicate: ``full``)."""
    if isinstance(placement, RaggedShard):
        return ragged_slice(full, len(placement.dims), placement.local_units, rank)
    if isinstance(placement, Shard):
        return shard_slice(full, placement.dim, world, rank)
    return full


@dataclass(frozen=True)
class Layout:
    """A random RaggedShard of a random shape (sizes prime or small, rows divisible by units)."""

    seed: int
    shape: tuple[int, ...]
    k: int
    units: tuple[int, ...]

    @property
    def placement(self) -> RaggedShard:
        return RaggedShard(tuple(range(self.k)), self.units)


def draw_layout(rng: random.Random, world: int, seed: int, max_ndim: int = 3) -> Layout:
    units = random_units(rng, world)
    ndim = rng.randint(1, max_ndim)
    shape = [rng.choice([1, 2, 3, 5, 7, 11, 13]) for _ in range(ndim)]
    shape[0] *= sum(units)
    return Layout(seed, tuple(shape), rng.randint(1, ndim), tuple(units))


def draw_layouts(world: int, n: int, seed: int, max_ndim: int = 3) -> list[Layout]:
    rng = random.Random(seed)
    return [draw_layout(rng, world, seed * 1000 + i, max_ndim) for i in range(n)]


def full_of(seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def ragged_coordinate(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the mesh dim carrying the RaggedShard (the last one)."""
    return mesh.get_local_rank(mesh.ndim - 1)


def ragged_from_full(mesh: DeviceMesh, full: torch.Tensor, layout: Layout,
                     requires_grad: bool = False) -> DTensor:
    """The RaggedShard DTensor of ``full`` on ``mesh``, built locally (no collective).

    On a 2-D mesh the placement is ``(Replicate(), RaggedShard)`` (HSDP).
    """
    local = ragged_slice(full, layout.k, layout.units, ragged_coordinate(mesh)).clone()
    placements = [Replicate()] * (mesh.ndim - 1) + [layout.placement]
    dt = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride(),
                            run_check=False)
    return dt.requires_grad_(requires_grad)


def expected_ragged(dt: DTensor, want_full: torch.Tensor, layout: Layout, what: str,
                    atol: float = 1e-6, rtol: float = 1e-6) -> None:
    """``dt`` keeps ``layout``'s placement and its local run equals the reference's run."""
    assert dt.placements[-1] == layout.placement, f"{what}: placements {dt.placements}"
    assert tuple(dt.shape) == tuple(want_full.shape), f"{what}: shape {dt.shape}"
    want = ragged_slice(want_full, layout.k, layout.units, ragged_coordinate(dt.device_mesh))
    torch.testing.assert_close(dt.to_local(), want, atol=atol, rtol=rtol, msg=what)


def mesh_of(mesh_shape: tuple[int, ...] | None) -> DeviceMesh:
    """The cached mesh of ``mesh_shape`` (default: 1-D over every rank)."""
    return device_mesh(*(mesh_shape or (torch.distributed.get_world_size(),)))


def replicated(mesh: DeviceMesh, full: torch.Tensor, last=None) -> DTensor:
    """``full`` distributed by torch over ``mesh``: Replicate, or ``last`` on the last mesh
    dim."""
    placements = [Replicate()] * mesh.ndim
    if last is not None:
        placements[-1] = last
    return torch_distribute_tensor(full.clone(), mesh, placements)


def layouts_for(world: int, shapes: list[tuple[int, ...]], ks: list[int], seed: int) -> list[Layout]:
    rng = random.Random(seed)
    out = []
    for i, (shape, k) in enumerate(zip(shapes, ks)):
        rows = math.prod(shape[:k])
        while True:
            units = random_units(rng, world)
            if rows % sum(units) == 0:
                break
        out.append(Layout(1000 + i, shape, k, tuple(units)))
    return out


SHAPES = [(12, 5), (6, 4, 3), (2, 6, 5), (60,), (4, 3, 5, 2)]
KS = [1, 2, 3, 1, 2]
KS_OTHER = [2, 1, 2, 1, 3]
