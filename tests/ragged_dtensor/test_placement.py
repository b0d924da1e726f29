"""RaggedShard as a value (equality, hashing, printing, pickling, validation) and its index math,
checked against a brute-force enumeration of which rank owns each element."""

from __future__ import annotations

import copy
import math
import pickle
import random

import pytest
from torch.distributed.tensor import Replicate, Shard

from ragged_dtensor import RaggedShard, ragged_math


def brute_force_owner(shape: tuple[int, ...], k: int, units: tuple[int, ...]) -> list[int]:
    """Owner rank of every flat element, by walking prefix rows one unit at a time."""
    rows = math.prod(shape[:k])
    per_row = math.prod(shape[k:])
    rows_per_unit = rows // sum(units)
    owners = []
    for rank, u in enumerate(units):
        owners += [rank] * (u * rows_per_unit * per_row)
    return owners


def test_equality_and_hash_are_by_normalised_value() -> None:
    a, b = RaggedShard((0,), (6, 4, 6, 0)), RaggedShard([0], [3, 2, 3, 0])
    assert a == b and hash(a) == hash(b)
    assert a.local_units == (3, 2, 3, 0)
    assert a != RaggedShard((0, 1), (3, 2, 3, 0))
    assert a != RaggedShard((0,), (3, 3, 2, 0))
    assert a != Shard(0) and a != Replicate()
    assert len({a, b, RaggedShard((0,), (1, 1, 1, 0))}) == 2


def test_is_neither_shard_replicate_nor_partial() -> None:
    p = RaggedShard((0,), (1, 2))
    assert not p.is_shard() and not p.is_replicate() and not p.is_partial()


def test_printing_and_pickling_round_trip() -> None:
    p = RaggedShard((0, 1), (0, 0, 5, 0))
    assert repr(p) == "RaggedShard(dims=(0, 1), local_units=(0, 0, 1, 0))"
    assert str(p) == "RS(0,1;0,0,1,0)"
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) == p


@pytest.mark.parametrize(
    ("dims", "units", "match"),
    [
        ((1,), (1, 1), "prefix"),
        ((0, 2), (1, 1), "prefix"),
        ((), (1, 1), "prefix"),
        ((0,), (1, -1), "non-negative"),
        ((0,), (0, 0), "positive"),
        ((0,), (), "positive"),
        ((0,), (1.5, 1), "integers"),
    ],
)
def test_constructor_rejects(dims: tuple[int, ...], units: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RaggedShard(dims, units)


def test_check_rejects_wrong_rank_count_and_non_dividing_units() -> None:
    p = RaggedShard((0,), (1, 2, 1))
    p.check((8, 3), 3)
    with pytest.raises(ValueError, match="3 local_units but its mesh dimension has 4"):
        p.check((8, 3), 4)
    with pytest.raises(ValueError, match="do not divide the 7 prefix rows"):
        p.check((7, 3), 3)
    with pytest.raises(ValueError, match="at least 2 dims"):
        RaggedShard((0, 1), (1,)).check((4,), 1)


def test_flat_ranges_match_brute_force_on_random_cases() -> None:
    rng = random.Random(0)
    for _ in range(300):
        world = rng.randint(1, 5)
        units = [rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(world)]
        if sum(units) == 0:
            units[rng.randrange(world)] = rng.randint(1, 4)
        ndim = rng.randint(1, 3)
        k = rng.randint(1, ndim)
        shape = [rng.choice([1, 2, 3, 5, 7]) for _ in range(ndim)]
        shape[0] *= sum(units)
        p = RaggedShard(tuple(range(k)), units)
        owners = brute_force_owner(tuple(shape), k, tuple(units))
        for rank in range(world):
            start, end = p.flat_range(shape, rank)
            assert [i for i, o in enumerate(owners) if o == rank] == list(range(start, end))
            assert p.local_numel(shape, rank) == end - start
        assert p.flat_bounds(shape)[-1] == math.prod(shape)


def test_chunk_bounds_follow_torch_chunk() -> None:
    import torch

    for size in range(0, 12):
        for world in range(1, 6):
            chunks = torch.arange(size).chunk(world) if size else ()
            expected = [len(c) for c in chunks] + [0] * (world - len(chunks))
            b = ragged_math.chunk_bounds(size, world)
            assert [b[r + 1] - b[r] for r in range(world)] == expected


def test_from_element_counts_picks_the_shortest_prefix() -> None:
    assert RaggedShard.from_element_counts((6, 4), (8, 0, 16)) == RaggedShard((0,), (1, 0, 2))
    assert RaggedShard.from_element_counts((6, 4), (6, 6, 12)) == RaggedShard((0, 1), (1, 1, 2))
    assert RaggedShard.from_element_counts((2, 3, 4), (12, 12)) == RaggedShard((0,), (1, 1))
    assert RaggedShard.from_element_counts((2, 3, 4), (8, 16)) == RaggedShard((0, 1), (1, 2))
    with pytest.raises(ValueError, match="sum to the numel 24"):
        RaggedShard.from_element_counts((6, 4), (8, 8))
    with pytest.raises(ValueError, match="0-d"):
        RaggedShard.from_element_counts((), (1,))


def test_from_element_counts_round_trips_random_counts() -> None:
    rng = random.Random(1)
    for _ in range(200):
        shape = tuple(rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 3)))
        numel = math.prod(shape)
        cuts = sorted(rng.randint(0, numel) for _ in range(rng.randint(0, 3)))
        bounds = [0, *cuts, numel]
        counts = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
        p = RaggedShard.from_element_counts(shape, counts)
        assert [p.local_numel(shape, r) for r in range(len(counts))] == counts
        shorter = len(p.dims) - 1
        if shorter >= 1:
            per_row = math.prod(shape[shorter:])
            assert any(c % per_row for c in counts)
