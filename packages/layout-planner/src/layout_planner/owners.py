"""Owner assignment for per-matrix optimizers (Muon, Shampoo): which rank computes which matrix."""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Mapping, Sequence


def assign_owners(
    costs: Sequence[float], world_size: int, fixed: Mapping[int, int] | None = None
) -> list[int]:
    """Give every item a rank so that the largest per-rank total cost is small.

    Greedy longest-processing-time: items in decreasing cost (ties by index) go one by one to
    the least-loaded rank (ties by the lowest rank). Pinned items (``fixed``, e.g. a matrix that
    already lies whole on one rank and so needs no communication) are placed first and count
    toward their rank's load. Pure arithmetic on the inputs, so every rank gets the same answer.

    Args:
        costs: Non-negative finite cost of each item (e.g. Newton-Schulz flops).
        world_size: Number of ranks, at least 1.
        fixed: Optional ``{item index: rank}`` pins.

    Returns:
        The owning rank of each item, in item order.

    Raises:
        ValueError: On a bad world size, a negative or non-finite cost, or a pin out of range.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    for index, cost in enumerate(costs):
        if not isinstance(cost, numbers.Real) or not math.isfinite(cost) or cost < 0:
            raise ValueError(f"cost of item {index} must be finite and non-negative, got {cost!r}")
    fixed = dict(fixed or {})
    loads = [0.0] * world_size
    owners = [-1] * len(costs)
    for index, rank in sorted(fixed.items()):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(costs):
            raise ValueError(f"fixed item index {index!r} is out of range for {len(costs)} items")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"fixed rank {rank!r} of item {index} is out of range for world_size {world_size}")
        owners[index] = rank
        loads[rank] += costs[index]
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    free = sorted((i for i in range(len(costs)) if i not in fixed), key=lambda i: (-costs[i], i))
    for index in free:
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + costs[index], rank))
    return owners
