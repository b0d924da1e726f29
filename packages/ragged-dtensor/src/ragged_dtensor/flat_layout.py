"""Which elements of the row-major flattened tensor each rank of one mesh dimension holds.

Every redistribution on a mesh dimension is computed from two such layouts, one for the
source placement and one for the target. ``RaggedShard`` and ``Shard(d)`` whose leading dims
``shape[:d]`` have one element are *contiguous*: rank ``r`` holds flat ``[b[r], b[r+1])``.
Any other ``Shard(d)`` holds a strided block; its elements, read in local row-major order,
still have increasing flat indices. So the part of a block inside any flat range is one slice
of the block, and the part of a flat range inside a block is at most three strided views
(head of a partial row, whole rows, tail): redistributions move exactly the elements that
change owner, with no index tensors and no gathering of the whole tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ragged_dtensor import ragged_math
from ragged_dtensor.placement import RaggedShard


@dataclass(frozen=True)
class FlatLayout:
    """The per-rank element sets of one placement on one mesh dimension of ``world_size`` ranks.

    A sharded layout has ``bounds`` when every rank holds one contiguous flat range, and
    ``shard_dim`` with torch's ``torch.chunk`` split ``chunks`` when it comes from ``Shard``
    (which then fixes the local shape); ``replicated`` means every rank holds everything.
    """

    shape: tuple[int, ...]
    world_size: int
    replicated: bool = False
    bounds: tuple[int, ...] | None = None
    shard_dim: int | None = None
    chunks: tuple[int, ...] | None = None

    @classmethod
    def of(cls, placement: Placement, shape: tuple[int, ...], world_size: int) -> FlatLayout:
        """The layout of ``placement`` (Replicate, Shard or RaggedShard) for a tensor of ``shape``.

        Raises:
            ValueError: if a RaggedShard does not fit the shape or the mesh dimension.
            NotImplementedError: for other placements.
        """
        if isinstance(placement, RaggedShard):
            placement.check(shape, world_size)
            return cls(shape, world_size, bounds=placement.flat_bounds(shape))
        if isinstance(placement, Replicate):
            return cls(shape, world_size, replicated=True)
        if type(placement) is Shard:
            dim = placement.dim % len(shape)
            chunks = ragged_math.chunk_bounds(shape[dim], world_size)
            bounds = None
            if math.prod(shape[:dim]) == 1:
                per_index = ragged_math.row_numel(shape, dim + 1)
                bounds = tuple(c * per_index for c in chunks)
            return cls(shape, world_size, bounds=bounds, shard_dim=dim, chunks=chunks)
        raise NotImplementedError(
            f"ragged redistribution does not support placement {placement!r}"
        )

    @property
    def contiguous(self) -> bool:
        """Whether every rank holds one contiguous flat range."""
        return self.bounds is not None

    @property
    def numel(self) -> int:
        """Elements of the global tensor."""
        return math.prod(self.shape)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor: full shape, the Shard block, or 1-D for ragged runs."""
        if self.replicated:
            return self.shape
        if self.shard_dim is not None:
            shape = list(self.shape)
            shape[self.shard_dim] = self.chunks[rank + 1] - self.chunks[rank]
            return tuple(shape)
        return (self.bounds[rank + 1] - self.bounds[rank],)

    def local_numel(self, rank: int) -> int:
        """Elements held by ``rank``."""
        return math.prod(self.local_shape(rank))

    def local_range(self, rank: int) -> tuple[int, int]:
        """The flat range ``[start, end)`` that ``rank`` holds (everything when replicated).

        Raises:
            ValueError: for a ``Shard`` layout that is not one contiguous range per rank.
        """
        if self.replicated:
            return 0, self.numel
        if self.bounds is None:
            raise ValueError(f"Shard({self.shard_dim}) of shape {self.shape} is not contiguous")
        return self.bounds[rank], self.bounds[rank + 1]

    def count_before(self, flat_index: int, rank: int) -> int:
        """How many of ``rank``'s elements have a flat index below ``flat_index``.

        A rank's elements, in local row-major order, have increasing flat indices, so the ones
        inside a flat range ``[x, y)`` are the local slice ``[count_before(x), count_before(y))``.
        """
        if self.replicated:
            return min(max(flat_index, 0), self.numel)
        if self.bounds is not None:
            lo, hi = self.bounds[rank], self.bounds[rank + 1]
            return min(max(flat_index - lo, 0), hi - lo)
        row, inner = self._row_geometry()
        if row == 0:
            return 0
        c0, c1 = self.chunks[rank], self.chunks[rank + 1]
        per_row = (c1 - c0) * inner
        return (flat_index // row) * per_row + min(max(flat_index % row - c0 * inner, 0), per_row)

    def owner_views(self, flat: torch.Tensor, start: int) -> list[list[torch.Tensor]]:
        """Views of ``flat`` grouped by the rank that holds each element under this layout.

        Args:
            flat: a 1-D tensor holding the flat elements ``[start, start + flat.numel())``.
            start: the flat index of ``flat[0]``.

        Returns:
            ``views[q]``: at most three views of ``flat`` (head of a partial row, a strided
            block of whole rows, tail) covering exactly rank ``q``'s elements, in flat order.
        """
        end = start + flat.numel()
        views: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        if self.bounds is not None:
            for q in range(self.world_size):
                lo = min(max(start, self.bounds[q]), end)
                hi = max(lo, min(end, self.bounds[q + 1]))
                if hi > lo:
                    views[q].append(flat[lo - start : hi - start])
            return views
        row, inner = self._row_geometry()
        if row == 0 or end == start:
            return views

        def partial_row(lo: int, hi: int) -> None:
            base = (lo // row) * row
            for q in range(self.world_size):
                a = max(lo, base + self.chunks[q] * inner)
                z = min(hi, base + self.chunks[q + 1] * inner)
                if z > a:
                    views[q].append(flat[a - start : z - start])

        pos = start
        if start % row:
            pos = min(end, (start // row + 1) * row)
            partial_row(start, pos)
        body_end = max(pos, (end // row) * row)
        if body_end > pos:
            body = flat[pos - start : body_end - start].view(-1, self.shape[self.shard_dim], inner)
            for q in range(self.world_size):
                if self.chunks[q + 1] > self.chunks[q]:
                    views[q].append(body[:, self.chunks[q] : self.chunks[q + 1], :])
        if end > body_end:
            partial_row(body_end, end)
        return views

    def _row_geometry(self) -> tuple[int, int]:
        """``(row, inner)``: elements per index of the dims up to ``shard_dim``, and after it."""
        inner = ragged_math.row_numel(self.shape, self.shard_dim + 1)
        return self.shape[self.shard_dim] * inner, inner
