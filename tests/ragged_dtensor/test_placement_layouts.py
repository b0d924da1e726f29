"""FlatLayout (which flat elements each rank holds under Shard(d) / RaggedShard / Replicate)
against brute force: the owner of every element read off torch.chunk / the ragged ranges."""

from __future__ import annotations

import math
import random

import torch
from torch.distributed.tensor import Replicate, Shard

from ragged_dtensor import RaggedShard
from ragged_dtensor.flat_layout import FlatLayout


def owners_by_brute_force(placement, shape: tuple[int, ...], world: int) -> torch.Tensor:
    """owner[i] = rank holding flat element i, by labelling each rank's local piece."""
    numel = math.prod(shape)
    owner = torch.full((numel,), -1, dtype=torch.long)
    index = torch.arange(numel).view(shape)
    if isinstance(placement, Shard):
        for rank, piece in enumerate(torch.chunk(index, world, placement.dim) if shape[placement.dim] else []):
            owner[piece.reshape(-1)] = rank
    else:
        for rank in range(world):
            start, end = placement.flat_range(shape, rank)
            owner[start:end] = rank
    return owner


def random_case(rng: random.Random) -> tuple[tuple[int, ...], int, object]:
    world = rng.randint(1, 5)
    shape = tuple(rng.choice([0, 1, 2, 3, 5, 7]) if rng.random() < 0.1 else rng.choice([1, 2, 3, 5, 7])
                  for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.5:
        return shape, world, Shard(rng.randrange(len(shape)))
    k = rng.randint(1, len(shape))
    rows = math.prod(shape[:k])
    units = [0] * world
    for _ in range(rows):
        units[rng.randrange(world)] += 1
    if rows == 0:
        units[0] = 1
    return shape, world, RaggedShard(tuple(range(k)), units)


def test_count_before_and_owner_views_match_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(400):
        shape, world, placement = random_case(rng)
        layout = FlatLayout.of(placement, shape, world)
        owner = owners_by_brute_force(placement, shape, world)
        numel = owner.numel()
        for rank in range(world):
            mine = (owner == rank).nonzero().reshape(-1)
            assert layout.local_numel(rank) == mine.numel(), (shape, placement, rank)
            for x in {0, numel, rng.randint(0, numel), rng.randint(0, numel)}:
                assert layout.count_before(x, rank) == int((mine < x).sum()), (shape, placement, x)
        start = rng.randint(0, numel)
        end = rng.randint(start, numel)
        flat = torch.arange(start, end)
        views = layout.owner_views(flat, start)
        for rank in range(world):
            got = torch.cat([v.reshape(-1) for v in views[rank]]) if views[rank] else flat[:0]
            want = torch.arange(start, end)[owner[start:end] == rank]
            assert torch.equal(got, want), (shape, placement, start, end, rank)
            assert all(v._base is flat for v in views[rank])  # views of flat, never copies


def test_replicate_layout_holds_everything() -> None:
    layout = FlatLayout.of(Replicate(), (3, 4), 3)
    assert layout.replicated and layout.local_shape(2) == (3, 4) and layout.count_before(5, 1) == 5
