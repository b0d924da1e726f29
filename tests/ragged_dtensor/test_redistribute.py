"""Every redistribution pair involving RaggedShard on 1..4 gloo ranks, against the full tensor.

Cases (shapes with prime sizes, units with zeros and one-hot, several dtypes) are drawn in the
parent with a fixed seed and run in batches, one ``ranks.run`` per world size. Each rank
rebuilds the full tensor from the case's seed and checks its own local piece against a slice
of it computed here (not by the library), plus ``full_tensor()``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ragged_dtensor import RaggedShard, distribute_tensor, local_shaped
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import expected_local, ragged_slice, random_units

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


@dataclass(frozen=True)
class Case:
    seed: int
    shape: tuple[int, ...]
    k: int
    units: tuple[int, ...]
    other_k: int
    other_units: tuple[int, ...]
    dtype: torch.dtype


def draw_cases(world: int, n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        units = random_units(rng, world)
        ndim = rng.randint(1, 3)
        shape = [rng.choice([1, 2, 3, 5, 7, 11]) for _ in range(ndim)]
        shape[0] *= sum(units)
        k = rng.randint(1, ndim)
        other_k = rng.randint(1, ndim)
        rows = math.prod(shape[:other_k])
        while True:
            other = random_units(rng, world)
            if rows % sum(other) == 0:
                break
        cases.append(
            Case(seed * 1000 + i, tuple(shape), k, tuple(units), other_k, tuple(other),
                 rng.choice(DTYPES))
        )
    return cases


def integer_full(case: Case) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed)
    values = torch.randint(-1000, 1000, case.shape, generator=gen)
    return values.to(case.dtype) / (1 if case.dtype == torch.int64 else 8)


def assert_local(dt: DTensor, full: torch.Tensor, placement, what: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    want = expected_local(full, placement, world, rank)
    got = dt.to_local()
    assert dt.placements == (placement,), what
    assert got.shape == want.shape and torch.equal(got, want), f"{what}: {got} != {want}"
    assert tuple(dt.shape) == tuple(full.shape), what


def round_trip_cases(cases: list[Case]) -> int:
    """Every pair through RaggedShard for each case; returns the number of checks made."""
    mesh = device_mesh(dist.get_world_size())
    world, rank = dist.get_world_size(), dist.get_rank()
    checks = 0
    for case in cases:
        full = integer_full(case)
        src = RaggedShard(tuple(range(case.k)), case.units)
        local = ragged_slice(full, case.k, src.local_units, rank).clone()
        dt = DTensor.from_local(local, mesh, [src], shape=full.shape, stride=full.stride(),
                                run_check=False)
        assert torch.equal(dt.full_tensor(), full), case
        other = RaggedShard(tuple(range(case.other_k)), case.other_units)
        one_hot = RaggedShard((0,), [int(r == case.seed % world) for r in range(world)])
        targets = [Replicate(), other, one_hot, *(Shard(d) for d in range(full.ndim))]
        for target in targets:
            what = f"{case} {src} -> {target}"
            moved = dt.redistribute(mesh, [target])
            assert_local(moved, full, target, what)
            back = moved.redistribute(mesh, [src])
            assert_local(back, full, src, what + " and back")
            checks += 2
        made = distribute_tensor(full, mesh, [src])
        assert_local(made, full, src, f"distribute_tensor {case}")
        rows = math.prod(full.shape[: case.k]) // sum(src.local_units) * src.local_units[rank]
        assert local_shaped(made).shape == (rows, *full.shape[case.k :])
        from_torch = distribute_tensor(full, mesh, [Replicate()]).redistribute(mesh, [src])
        assert_local(from_torch, full, src, f"Replicate -> {src}")
        checks += 2
    return checks


def partial_cases(cases: list[Case]) -> int:
    """Partial(sum/avg/max/min) -> RaggedShard is a reduce-scatter."""
    mesh = device_mesh(dist.get_world_size())
    world, rank = dist.get_world_size(), dist.get_rank()
    for i, case in enumerate(cases):
        op = ("sum", "avg", "max", "min")[i % 4]
        dtype = torch.float64 if case.dtype != torch.int64 else torch.int64
        parts = [
            torch.randint(-99, 99, case.shape, generator=torch.Generator().manual_seed(case.seed + p),
                          dtype=torch.int64).to(dtype)
            for p in range(world)
        ]
        stacked = torch.stack(parts)
        want = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0),
                "avg": stacked.sum(0) / world if dtype.is_floating_point else stacked.sum(0) // world}[op]
        placement = RaggedShard(tuple(range(case.k)), case.units)
        dt = DTensor.from_local(parts[rank], mesh, [Partial(op)], shape=want.shape,
                                stride=want.stride(), run_check=False)
        moved = dt.redistribute(mesh, [placement])
        assert_local(moved, want, placement, f"Partial({op}) -> {placement} {case}")
    return len(cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_round_trips_through_every_pair(ranks, world: int) -> None:
    cases = draw_cases(world, 30, seed=world)
    # empty tensors: zero prefix rows, and rows of zero elements
    units = tuple(range(1, world + 1))
    cases += [Case(1, (0, 3), 1, units, 2, units, torch.float32),
              Case(2, (sum(units), 0), 1, units, 1, units, torch.float32)]
    checks = ranks.run(world, round_trip_cases, cases)
    assert checks[0] == sum(2 * (4 + len(c.shape)) for c in cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_partial_to_ragged_reduces(ranks, world: int) -> None:
    cases = draw_cases(world, 8, seed=100 + world)
    assert ranks.run(world, partial_cases, cases) == [8] * world


def error_cases() -> int:
    """Placement errors are global facts: every rank raises the same ValueError, no collective."""
    mesh = device_mesh(dist.get_world_size())
    world = dist.get_world_size()
    dt = distribute_tensor(torch.arange(6.0 * world), mesh, [RaggedShard((0,), [1] * world)])
    with pytest.raises(ValueError, match=f"has {world + 1} local_units but its mesh dimension has {world}"):
        dt.redistribute(mesh, [RaggedShard((0,), [1] * (world + 1))])
    with pytest.raises(ValueError, match="do not divide the 5 prefix rows"):
        distribute_tensor(torch.zeros(5, 2), mesh, [RaggedShard((0,), [1] * (world - 1) + [2])])
    with pytest.raises(ValueError, match="at least 2 dims"):
        distribute_tensor(torch.zeros(6), mesh, [RaggedShard((0, 1), [1] * world)])
    assert torch.equal(dt.full_tensor(), torch.arange(6.0 * world))  # the pool is still healthy
    return 3


def test_placement_errors_raise_on_every_rank(ranks) -> None:
    assert ranks.run(3, error_cases) == [3] * 3
