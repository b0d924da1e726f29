"""The multi-process harness itself: results, failure propagation, timeouts, reuse."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, RankPool, RankTimeout


def _sum_of_ranks(offset: int) -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _rank_one_raises_while_others_wait() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    # The healthy ranks enter a collective that rank 1 never joins.
    dist.barrier()


def _sleeps(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_runs_the_same_case(ranks, world_size: int) -> None:
    results = ranks.run(world_size, _sum_of_ranks, 10)
    expected = sum(range(world_size)) + 10 * world_size
    assert results == [(r, float(expected)) for r in range(world_size)]


def test_failing_rank_is_reported_with_traceback_and_pool_recovers() -> None:
    pool = RankPool(3)
    try:
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_rank_one_raises_while_others_wait, timeout=60)
        # The other ranks were stuck in a barrier: the pool must not wait for the collective
        # timeout, only for the short grace period.
        assert time.monotonic() - start < 30
        assert set(info.value.failures) == {1}
        assert "ValueError: rank one is broken" in info.value.failures[1]
        assert "_rank_one_raises_while_others_wait" in info.value.failures[1]
        assert info.value.missing == [0, 2]
        # A fresh pool replaces the broken one for the next case.
        assert [r for r, _ in pool.run(_sum_of_ranks, 0)] == [0, 1, 2]
    finally:
        pool.close()


def test_hanging_case_times_out_instead_of_hanging() -> None:
    pool = RankPool(2)
    try:
        with pytest.raises(RankTimeout) as info:
            pool.run(_sleeps, 60, timeout=3)
        assert info.value.missing == [0, 1]
        assert pool.run(_sum_of_ranks, 1) == [(0, 3.0), (1, 3.0)]
    finally:
        pool.close()
