"""assign_owners(): greedy LPT checked against brute force and its own rules."""

from __future__ import annotations

import itertools
import random

import pytest

from layout_planner import assign_owners


def _makespan(costs, owners, world) -> float:
    loads = [0.0] * world
    for c, r in zip(costs, owners):
        loads[r] += c
    return max(loads)


def test_lpt_within_its_guarantee_of_the_optimum() -> None:
    rng = random.Random(7)
    for _ in range(150):
        world = rng.randint(1, 4)
        costs = [rng.choice([1, 2, 3, 5, 8, 13]) * rng.random() for _ in range(rng.randint(1, 7))]
        owners = assign_owners(costs, world)
        assert all(0 <= r < world for r in owners)
        best = min(_makespan(costs, o, world) for o in itertools.product(range(world), repeat=len(costs)))
        assert _makespan(costs, owners, world) <= (4 / 3 - 1 / (3 * world)) * best + 1e-9  # Graham's LPT bound


def test_ties_broken_by_index_and_rank() -> None:
    assert assign_owners([1, 1, 1, 1], 2) == [0, 1, 0, 1]
    assert assign_owners([5, 9, 5], 2) == [1, 0, 1]  # 9 -> rank 0, then 5 (index 0) -> rank 1, 5 -> rank 1 (load 5 < 9)


def test_fixed_items_stay_and_count_toward_load() -> None:
    owners = assign_owners([10, 3, 3, 4], 2, fixed={0: 1})
    assert owners[0] == 1
    assert owners[1:] == [0, 0, 0]  # rank 1 already carries 10


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1.0], 0), "world_size"),
        (([-1.0], 2), "item 0"),
        (([float("nan")], 2), "item 0"),
        (([1.0], 2, {3: 0}), "index 3"),
        (([1.0], 2, {0: 2}), "rank 2"),
    ],
)
def test_bad_input(args, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        assign_owners(*args)
