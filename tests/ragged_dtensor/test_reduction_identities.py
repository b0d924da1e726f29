"""Reductions without an identity on ranks that hold no element, with data chosen so that a
wrong identity shows: all-negative floats for max, all-positive for min, integers at the ends
of their range, bools. And the identity that fills a RaggedShard -> Partial(max/min) tensor,
for float, integer and bool dtypes; max of an empty tensor raises as on one device."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_dtensor import RaggedShard, distribute_tensor
from ragged_dtensor.redistribute import redistribute_ragged_local_tensor
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import ragged_slice

DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool)

OPS = {
    "max": lambda x: x.max(),
    "amax": lambda x: x.amax(),
    "min": lambda x: x.min(),
    "amin": lambda x: x.amin(dim=(0, 1)),
}


def _data(dtype: torch.dtype, largest: bool, shape: tuple[int, ...]) -> torch.Tensor:
    """Values on the side where a wrong identity (0, or the wrong end) would win."""
    gen = torch.Generator().manual_seed(3)
    offsets = torch.randint(1, 50, shape, generator=gen)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool) if largest else torch.ones(shape, dtype=torch.bool)
    if dtype.is_floating_point:
        return (-offsets if largest else offsets).to(dtype) / 4
    info = torch.iinfo(dtype)
    return (info.min + offsets if largest else info.max - offsets).to(dtype)


def reduction_cases(units_list: list[tuple[int, ...]]) -> int:
    """max/amax/min/amin of data a wrong identity would beat, against one device."""
    mesh = device_mesh(dist.get_world_size())
    checks = 0
    for units in units_list:
        placement = RaggedShard((0,), units)
        shape = (2 * sum(units), 3)
        for dtype in DTYPES:
            for name, op in OPS.items():
                full = _data(dtype, name in ("max", "amax"), shape)
                got = op(distribute_tensor(full, mesh, [placement])).full_tensor()
                assert got.dtype == op(full).dtype and torch.equal(got, op(full)), (name, dtype, units)
                checks += 1
    return checks


def partial_fill_cases(units_list: list[tuple[int, ...]]) -> int:
    """RaggedShard -> Partial(max/min): the elements this rank does not hold are the
    identity of the reduction for the dtype, its own run is kept."""
    mesh = device_mesh(dist.get_world_size())
    rank = dist.get_rank()
    checks = 0
    for units in units_list:
        placement = RaggedShard((0,), units)
        shape = (2 * sum(units), 3)
        for dtype in DTYPES:
            full = _data(dtype, True, shape)
            meta = TensorMeta(torch.Size(shape), (3, 1), dtype)
            src = DTensorSpec(mesh, (placement,), tensor_meta=meta)
            run = ragged_slice(full, 1, units, rank).clone()
            for reduce_op in ("max", "min"):
                dst = DTensorSpec(mesh, (Partial(reduce_op),), tensor_meta=meta)
                filled = redistribute_ragged_local_tensor(run, src, dst)
                want = torch.full(shape, _identity(reduce_op, dtype), dtype=dtype)
                ragged_slice(want, 1, units, rank).copy_(run)
                assert torch.equal(filled, want), (reduce_op, dtype)
                checks += 1
    return checks


def empty_case(units: tuple[int, ...]) -> bool:
    """max of an empty tensor raises on every rank, as on one device."""
    mesh = device_mesh(dist.get_world_size())
    empty = distribute_tensor(torch.zeros(0, 3), mesh, [RaggedShard((0,), units)])
    for op in (*OPS.values(), lambda x: torch.linalg.vector_norm(x, math.inf)):
        with pytest.raises((RuntimeError, IndexError)) as info:
            op(torch.zeros(0, 3))
        with pytest.raises(type(info.value), match=re.escape(str(info.value)[:30])):
            op(empty)
    return True


def _identity(reduce_op: str, dtype: torch.dtype) -> object:
    """Written out per dtype kind here, independently of the library."""
    if dtype == torch.bool:
        return reduce_op == "min"
    if dtype.is_floating_point:
        return -math.inf if reduce_op == "max" else math.inf
    return torch.iinfo(dtype).min if reduce_op == "max" else torch.iinfo(dtype).max


def _units(world: int) -> list[tuple[int, ...]]:
    return [tuple(int(r == world - 1) for r in range(world)), tuple([2, 0] * (world // 2))]


@pytest.mark.parametrize("world", [2, 4])
def test_reductions_without_identity_on_empty_ranks(ranks, world: int) -> None:
    expected = 2 * len(DTYPES) * len(OPS)
    assert ranks.run(world, reduction_cases, _units(world)) == [expected] * world


def test_partial_fill_uses_the_dtype_identity(ranks) -> None:
    assert ranks.run(4, partial_fill_cases, _units(4)) == [2 * len(DTYPES) * 2] * 4


def test_max_of_an_empty_tensor_raises_as_on_one_device(ranks) -> None:
    assert ranks.run(2, empty_case, (1, 2)) == [True] * 2
