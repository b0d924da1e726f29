"""Index arithmetic of the RaggedShard layout, in plain integers (no torch, no communication).

A RaggedShard of a tensor flattens the leading ``k`` dims (``dims = (0, ..., k-1)``) into
*prefix rows* of ``row_numel = prod(shape[k:])`` elements each, groups the rows into
``sum(local_units)`` equal *units*, and gives rank ``r`` the ``local_units[r]`` consecutive
units after those of ranks ``0..r-1``. Every rank's piece is therefore one contiguous range of
the row-major flattened tensor, which is what every redistribution path and the checkpoint
hooks compute with. Keeping the arithmetic here, apart from collectives, lets it be tested
exhaustively without processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate


def normalize_dims(dims: Sequence[int]) -> tuple[int, ...]:
    """Check that ``dims`` is a non-empty prefix ``(0, 1, ..., k-1)`` and return it as a tuple.

    Raises:
        ValueError: if ``dims`` is empty or not the prefix of the tensor dims.
    """
    dims = tuple(int(d) for d in dims)
    if not dims or dims != tuple(range(len(dims))):
        raise ValueError(
            f"RaggedShard dims must be a non-empty prefix (0, ..., k-1) of the tensor dims, got {dims}"
        )
    return dims


def normalize_units(units: Sequence[int]) -> tuple[int, ...]:
    """Divide per-rank unit counts by their gcd, so equal layouts compare equal.

    Raises:
        ValueError: if a count is negative or not an integer, or all counts are zero.
    """
    out = []
    for u in units:
        if isinstance(u, bool) or int(u) != u:
            raise ValueError(f"RaggedShard local_units must be integers, got {tuple(units)}")
        out.append(int(u))
    if any(u < 0 for u in out):
        raise ValueError(f"RaggedShard local_units must be non-negative, got {tuple(out)}")
    if not out or sum(out) == 0:
        raise ValueError(
            f"RaggedShard local_units need at least one positive count, got {tuple(out)}"
        )
    g = math.gcd(*out)
    return tuple(u // g for u in out)


def prefix_rows(shape: Sequence[int], ndims: int) -> int:
    """Number of prefix rows: the product of the first ``ndims`` sizes of ``shape``."""
    return math.prod(shape[:ndims])


def row_numel(shape: Sequence[int], ndims: int) -> int:
    """Elements per prefix row: the product of the sizes after the first ``ndims``."""
    return math.prod(shape[ndims:])


def unit_rows(shape: Sequence[int], ndims: int, units: Sequence[int]) -> int:
    """Prefix rows per unit.

    Raises:
        ValueError: if the tensor has fewer than ``ndims`` dims or ``sum(units)`` does not
            divide its prefix rows (RaggedShard never pads).
    """
    if len(shape) < ndims:
        raise ValueError(
            f"RaggedShard over dims {tuple(range(ndims))} needs a tensor of at least {ndims} "
            f"dims, got shape {tuple(shape)}"
        )
    rows, total = prefix_rows(shape, ndims), sum(units)
    if rows % total:
        raise ValueError(
            f"RaggedShard local_units {tuple(units)} (sum {total}) do not divide the "
            f"{rows} prefix rows of shape {tuple(shape)} over dims {tuple(range(ndims))}"
        )
    return rows // total


def flat_bounds(shape: Sequence[int], ndims: int, units: Sequence[int]) -> tuple[int, ...]:
    """Rank boundaries in elements: rank ``r`` owns flat ``[b[r], b[r+1])``; ``len(b) = ranks + 1``."""
    unit_numel = unit_rows(shape, ndims, units) * row_numel(shape, ndims)
    return tuple(c * unit_numel for c in accumulate(units, initial=0))


def flat_range(shape: Sequence[int], ndims: int, units: Sequence[int], rank: int) -> tuple[int, int]:
    """The flat element range ``[start, end)`` that ``rank`` owns."""
    b = flat_bounds(shape, ndims, units)
    return b[rank], b[rank + 1]


def chunk_bounds(size: int, world_size: int) -> tuple[int, ...]:
    """Boundaries of torch's ``Shard`` split (``torch.chunk`` semantics) of ``size`` indices.

    Chunks have ``ceil(size / world_size)`` indices; trailing ranks may get fewer or none.
    """
    chunk = -(-size // world_size) if size else 0
    return tuple(min(r * chunk, size) for r in range(world_size + 1))


def element_counts_to_units(shape: Sequence[int], counts: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """Shortest prefix ``k`` and units such that every count is whole prefix rows of ``shape``.

    Returns:
        ``(k, units)`` where ``units[r] = counts[r] // row_numel(shape, k)`` (before gcd).

    Raises:
        ValueError: for a 0-d shape, negative counts or counts not summing to the numel.
    """
    if len(shape) == 0:
        raise ValueError("RaggedShard needs a tensor of at least one dim, got a 0-d shape")
    counts = tuple(int(c) for c in counts)
    numel = math.prod(shape)
    if any(c < 0 for c in counts) or sum(counts) != numel:
        raise ValueError(
            f"element counts {counts} must be non-negative and sum to the numel {numel} "
            f"of shape {tuple(shape)}"
        )
    if numel == 0:
        return len(shape), (1,) * len(counts)
    for k in range(1, len(shape) + 1):
        per_row = row_numel(shape, k)
        if all(c % per_row == 0 for c in counts):
            return k, tuple(c // per_row for c in counts)
    raise AssertionError("unreachable: k = ndim always divides")
