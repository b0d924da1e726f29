"""Split a flat (row-major) element range of a tensor into the fewest N-D boxes.

A RaggedShard rank holds one contiguous run of the flattened tensor, but a checkpoint
(``torch.distributed.checkpoint``) describes every stored piece as an N-D box
(``offsets``, ``sizes``). A run that starts or ends inside a row is not one box; this module
finds the minimum number of disjoint boxes whose union is exactly the run.

The search is a recursion over the leading dim. Write the run as ``[a, b)`` with
``a = (a0, t)`` and ``b - 1 = (b0, p - 1)`` in (leading index, offset inside the sub-tensor).
When ``a0 < b0`` the run is the suffix ``[t, end)`` of sub-tensor ``a0``, the whole
sub-tensors between, and the prefix ``[0, p)`` of sub-tensor ``b0``. Besides cutting it
into those three parts, a box may span several leading indices: for a split point ``s`` with
``t <= s <= p``, the boxes of ``[s, end)`` stretched over ``a0 .. b0-1`` and the boxes of
``[0, s)`` stretched over ``a0+1 .. b0`` cover everything except ``[t, s)`` in ``a0`` and
``[s, p)`` in ``b0``. Only split points on a boundary of some sub-dim can save boxes, so the
candidates are few. This recursion is minimal for runs over one or two dims (checked
exhaustively in the tests), but from three dims on a minimal split can be a "pinwheel" of
boxes that no leading-dim recursion produces. There an exact search finishes the job: along
each dim, the run's membership changes only at the start's and end's digits, so the index
space compresses to at most five segments per dim, and a minimal partition of the compressed
grid (branch and bound, starting from the recursion's count) expands to a minimal one of the
run. The search runs for three cut dims (at most 125 grid cells, well under a second); from
four on its cost explodes and the recursion's answer is kept (one box above the minimum on
some runs of a 2x2x2x2 tensor, in an exhaustive check).

Whole trailing dims (the suffix a RaggedShard never cuts) are folded away first: a partition
of the run's prefix rows is a partition of the run, and no partition of the run has fewer
boxes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of one N-D box, in the tensor's index space."""


def _stretch(boxes: Sequence[Box], start: int, length: int) -> list[Box]:
    """Prepend a leading dim ``[start, start + length)`` to boxes of the sub-tensor."""
    return [((start, *offsets), (length, *sizes)) for offsets, sizes in boxes]


def _split_points(sub: tuple[int, ...], t: int, p: int) -> set[int]:
    """Candidate split points in ``[t, p]``: ``t``, ``p`` and the multiples of every
    sub-dim stride nearest to them from inside."""
    points = {t, p}
    for j in range(len(sub)):
        stride = math.prod(sub[j:])
        up, down = -(-t // stride) * stride, (p // stride) * stride
        points.update(x for x in (up, down) if t <= x <= p)
    return points


@lru_cache(maxsize=4096)
def _boxes(shape: tuple[int, ...], a: int, b: int) -> tuple[Box, ...]:
    if a >= b:
        return ()
    if len(shape) == 1:
        return (((a,), (b - a,)),)
    sub = shape[1:]
    inner = math.prod(sub)
    a0, t = divmod(a, inner)
    b0, p = divmod(b - 1, inner)
    p += 1  # the run holds [0, p) of sub-tensor b0, with 0 < p <= inner
    if a0 == b0:
        return tuple(_stretch(_boxes(sub, t, p), a0, 1))
    zeros = (0,) * len(sub)
    # Three parts: head [t, inner) of a0, whole sub-tensors, tail [0, p) of b0 (the head and
    # tail merge into the middle block when they are whole).
    lo = a0 if t == 0 else a0 + 1
    hi = b0 + 1 if p == inner else b0
    best: list[Box] = []
    if t > 0:
        best += _stretch(_boxes(sub, t, inner), a0, 1)
    if hi > lo:
        best.append(((lo, *zeros), (hi - lo, *sub)))
    if p < inner:
        best += _stretch(_boxes(sub, 0, p), b0, 1)
    if t <= p:
        span = b0 - a0
        for s in sorted(_split_points(sub, t, p)):
            candidate = (
                _stretch(_boxes(sub, s, inner), a0, span)
                + _stretch(_boxes(sub, 0, s), a0 + 1, span)
                + _stretch(_boxes(sub, t, s), a0, 1)
                + _stretch(_boxes(sub, s, p), b0, 1)
            )
            if len(candidate) < len(best):
                best = candidate
    return tuple(best)


def _segments(size: int, lo_digit: int, hi_digit: int) -> list[tuple[int, int]]:
    """The index ranges of one dim on which membership in the run cannot change."""
    cuts = sorted({0, size, lo_digit, lo_digit + 1, hi_digit, hi_digit + 1} & set(range(size + 1)))
    return list(zip(cuts[:-1], cuts[1:]))


def _digits(shape: tuple[int, ...], index: int) -> list[int]:
    out = []
    for size in reversed(shape):
        index, digit = divmod(index, size)
        out.append(digit)
    return out[::-1]


def _exact_boxes(shape: tuple[int, ...], a: int, b: int, bound: int) -> list[Box] | None:
    """A partition of ``[a, b)`` into fewer than ``bound`` boxes, or ``None`` if none exists.

    Works on the compressed grid with cells as bits (row-major, so the lowest set bit is the
    lowest free cell, which must be the lowest corner of the box covering it).
    """
    first, last = _digits(shape, a), _digits(shape, b - 1)
    segments = [_segments(n, lo, hi) for n, lo, hi in zip(shape, first, last)]
    grid = tuple(len(seg) for seg in segments)
    grid_strides = box_strides(grid)
    strides = box_strides(shape)
    cells = list(itertools.product(*(range(n) for n in grid)))
    region = 0
    for bit, cell in enumerate(cells):
        if a <= sum(segments[d][c][0] * strides[d] for d, c in enumerate(cell)) < b:
            region |= 1 << bit
    # every box of the grid, as a bit mask, listed under its lowest cell (largest first)
    by_corner: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    for corner in cells:
        for sizes in itertools.product(*(range(1, n - c + 1) for n, c in zip(grid, corner))):
            mask = 0
            for cell in itertools.product(*(range(c, c + n) for c, n in zip(corner, sizes))):
                mask |= 1 << sum(x * st for x, st in zip(cell, grid_strides))
            if mask & ~region == 0:
                index = sum(x * st for x, st in zip(corner, grid_strides))
                by_corner.setdefault(index, []).append((mask, corner, sizes))
    for boxes in by_corner.values():
        boxes.sort(key=lambda item: -math.prod(item[2]))
    # masks of the cells that have a neighbour below / above in each dim
    has_below = [sum(1 << i for i, c in enumerate(cells) if c[d] > 0) for d in range(len(grid))]
    has_above = [sum(1 << i for i, c in enumerate(cells) if c[d] < grid[d] - 1)
                 for d in range(len(grid))]

    def lower_bound(free: int) -> int:
        """Cells with no free neighbour below (or above) in any dim are a lowest (highest)
        corner each, so they lie in distinct boxes."""
        below = above = 0
        for d, st in enumerate(grid_strides):
            below |= (free << st) & has_below[d]
            above |= (free >> st) & has_above[d]
        return max(bin(free & ~below).count("1"), bin(free & ~above).count("1"))

    best: list[list[tuple[tuple[int, ...], tuple[int, ...]]] | None] = [None]
    limit = [bound]
    failed: dict[int, int] = {}

    def search(free: int, chosen: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        if not free:
            best[0], limit[0] = list(chosen), len(chosen)
            return
        budget = limit[0] - len(chosen) - 1  # boxes we may still add and beat the best
        if budget < lower_bound(free) or failed.get(free, -1) >= budget:
            return
        lowest = (free & -free).bit_length() - 1
        for mask, corner, sizes in by_corner.get(lowest, ()):
            if mask & ~free == 0:
                chosen.append((corner, sizes))
                search(free & ~mask, chosen)
                chosen.pop()
        if best[0] is None or len(best[0]) > len(chosen) + budget:
            failed[free] = max(failed.get(free, -1), budget)

    search(region, [])
    if best[0] is None:
        return None
    return [
        (
            tuple(segments[d][c][0] for d, c in enumerate(corner)),
            tuple(segments[d][c + n - 1][1] - segments[d][c][0]
                  for d, (c, n) in enumerate(zip(corner, sizes))),
        )
        for corner, sizes in best[0]
    ]


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The fewest disjoint N-D boxes whose union is the flat range ``[start, end)``.

    Args:
        shape: the tensor's shape (at least one dim).
        start: first flat (row-major) element index of the range.
        end: one past the last index; ``start == end`` gives no boxes.

    Returns:
        ``(offsets, sizes)`` per box, in increasing order of their first flat index.

    Raises:
        ValueError: for a 0-d shape or a range outside the tensor.
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("flat_range_boxes needs a tensor of at least one dim")
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"range [{start}, {end}) is outside a tensor of shape {shape}")
    if start == end:
        return []
    # fold the whole trailing dims into the rows they make up
    k = len(shape)
    while k > 1 and start % math.prod(shape[k - 1:]) == 0 and end % math.prod(shape[k - 1:]) == 0:
        k -= 1
    row = math.prod(shape[k:])
    prefix, a, b = shape[:k], start // row, end // row
    boxes = list(_boxes(prefix, a, b))
    if k == 3 and len(boxes) >= 3:
        boxes = _exact_boxes(prefix, a, b, len(boxes)) or boxes
    full = [(offsets + (0,) * (len(shape) - k), sizes + shape[k:]) for offsets, sizes in boxes]
    return sorted(full, key=lambda box: box_first_index(shape, box))


def box_first_index(shape: Sequence[int], box: Box) -> int:
    """Flat row-major index of a box's first element."""
    index = 0
    for size, offset in zip(shape, box[0]):
        index = index * size + offset
    return index


def box_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major (contiguous) strides of ``shape``."""
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
