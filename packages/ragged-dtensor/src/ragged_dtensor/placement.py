"""The ``RaggedShard`` DTensor placement: whole units of uneven size, one contiguous run per rank.

It subclasses torch's pybind ``Placement`` rather than ``Shard``: torch's ``Shard`` code paths
assume even ``torch.chunk`` splits and silently mis-handle ragged data, while an unknown
``Placement`` is ignored by shard-order checks and reaches our own redistribution and
propagation hooks, which constructing the first RaggedShard installs
(:mod:`ragged_dtensor.torch_patches`). Equality and hashing are by value because DTensor's native dispatch cache
and ``DTensorSpec`` hashing use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor import ragged_math, torch_patches


class RaggedShard(Placement):
    """Shard the flattened prefix ``dims`` of a tensor into whole units, unevenly across ranks.

    Rank ``r`` of the mesh dimension owns the flat range
    ``[sum(u[:r]) * unit, sum(u[:r+1]) * unit)`` of the tensor flattened row-major, where
    ``u = local_units`` and ``unit = prod(shape[:k]) // sum(u)`` prefix rows of
    ``prod(shape[k:])`` elements each. The local tensor is that range as a contiguous 1-D
    tensor.

    Args:
        dims: a prefix ``(0, ..., k-1)`` of the tensor dims, flattened together.
        local_units: one relative unit count per rank of the mesh dimension; zeros allowed,
            normalised by their gcd (``(6, 4, 6, 0)`` equals ``(3, 2, 3, 0)``).

    Raises:
        ValueError: if ``dims`` is not a prefix or ``local_units`` has a negative entry or
            no positive entry.
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]) -> None:
        # the first RaggedShard installs torch_patches: no RaggedShard DTensor exists before
        torch_patches.install()
        Placement.__init__(self)
        self._dims = ragged_math.normalize_dims(dims)
        self._local_units = ragged_math.normalize_units(local_units)

    @classmethod
    def from_element_counts(cls, shape: Sequence[int], counts: Sequence[int]) -> RaggedShard:
        """The RaggedShard whose rank ``r`` holds ``counts[r]`` elements of a tensor of ``shape``.

        Picks the shortest ``dims`` prefix such that every count is whole prefix rows (so
        :func:`ragged_dtensor.local_shaped` can give the widest row shape).

        Args:
            shape: the global tensor shape.
            counts: per-rank element counts, summing to the tensor's numel.

        Returns:
            The matching placement.

        Raises:
            ValueError: if the counts are negative or do not sum to the numel.
        """
        k, units = ragged_math.element_counts_to_units(tuple(shape), counts)
        return cls(tuple(range(k)), units)

    @property
    def dims(self) -> tuple[int, ...]:
        """The flattened prefix dims ``(0, ..., k-1)``."""
        return self._dims

    @property
    def local_units(self) -> tuple[int, ...]:
        """Per-rank unit counts, divided by their gcd."""
        return self._local_units

    @property
    def num_ranks(self) -> int:
        """The mesh-dimension size this placement is written for (``len(local_units)``)."""
        return len(self._local_units)

    def check(self, shape: Sequence[int], mesh_dim_size: int) -> None:
        """Check this placement against a global shape and the size of its mesh dimension.

        Args:
            shape: the global tensor shape.
            mesh_dim_size: number of ranks on the mesh dimension carrying this placement.

        Raises:
            ValueError: if ``len(local_units) != mesh_dim_size`` or the units do not divide
                the flattened prefix rows.
        """
        if self.num_ranks != mesh_dim_size:
            raise ValueError(
                f"{self!r} has {self.num_ranks} local_units but its mesh dimension has "
                f"{mesh_dim_size} ranks"
            )
        ragged_math.unit_rows(tuple(shape), len(self._dims), self._local_units)

    def flat_bounds(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Rank boundaries in elements: rank ``r`` owns flat ``[b[r], b[r+1])``.

        Args:
            shape: the global tensor shape.

        Returns:
            ``num_ranks + 1`` non-decreasing offsets from 0 to the numel.
        """
        return ragged_math.flat_bounds(tuple(shape), len(self._dims), self._local_units)

    def flat_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """The flat element range ``[start, end)`` owned by coordinate ``rank`` of the mesh dim.

        Args:
            shape: the global tensor shape.
            rank: the coordinate on this placement's mesh dimension.

        Returns:
            ``(start, end)`` in elements of the row-major flattened tensor.
        """
        return ragged_math.flat_range(tuple(shape), len(self._dims), self._local_units, rank)

    def local_numel(self, shape: Sequence[int], rank: int) -> int:
        """Number of elements coordinate ``rank`` holds.

        Args:
            shape: the global tensor shape.
            rank: the coordinate on this placement's mesh dimension.

        Returns:
            ``end - start`` of :meth:`flat_range`.
        """
        start, end = self.flat_range(shape, rank)
        return end - start

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RaggedShard):
            return False
        return self._dims == other._dims and self._local_units == other._local_units

    def __hash__(self) -> int:
        return hash(("RaggedShard", self._dims, self._local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self._dims}, local_units={self._local_units})"

    def __str__(self) -> str:
        return f"RS({','.join(map(str, self._dims))};{','.join(map(str, self._local_units))})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RaggedShard, (self._dims, self._local_units))

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        return f"RaggedShard(dims={self._dims}, local_units={self._local_units})", {
            "RaggedShard": RaggedShard
        }


def ragged_mesh_dims(placements: Sequence[Placement]) -> tuple[int, ...]:
    """Every mesh dim carrying a ``RaggedShard`` in ``placements`` (the one place that asks).

    Args:
        placements: a DTensor's placements, one per mesh dim.

    Returns:
        The mesh dims, in order (the package supports at most one).
    """
    # Type identity in a plain loop, as in is_ragged: placements' metaclass makes isinstance a
    # Python-level check, and this runs on every from_local and redistribute of any DTensor.
    dims: tuple[int, ...] = ()
    for i, p in enumerate(placements):
        if type(p) is RaggedShard:
            dims += (i,)
    return dims


def find_ragged(placements: Sequence[Placement]) -> tuple[int, RaggedShard] | None:
    """The first mesh dim carrying a ``RaggedShard`` in ``placements`` and that placement.

    Args:
        placements: a DTensor's placements, one per mesh dim.

    Returns:
        ``(mesh_dim, placement)``, or ``None`` when no placement is a ``RaggedShard``.
    """
    dims = ragged_mesh_dims(placements)
    if not dims:
        return None
    placement = placements[dims[0]]
    assert isinstance(placement, RaggedShard)
    return dims[0], placement


def is_ragged(x: object) -> bool:
    """Whether ``x`` carries a ``RaggedShard``: the one predicate every package asks.

    Args:
        x: a DTensor, a ``DTensorSpec``, a single placement, or a sequence of placements;
            anything else (a plain tensor, ``None``) is not ragged.

    Returns:
        ``True`` when one of its placements is a ``RaggedShard``.
    """
    # Type identity in a plain loop: isinstance against the pybind-based class and a generator
    # each cost about a microsecond, and this runs on every DTensor op routed through the
    # package (0.3 us this way).
    if type(x) is RaggedShard:
        return True
    placements = getattr(x, "placements", x)
    if type(placements) is not tuple and type(placements) is not list:
        return False
    for p in placements:
        if type(p) is RaggedShard:
            return True
    return False


def ragged_mesh_dim(placements: Sequence[Placement]) -> int | None:
    """The mesh dim carrying a ``RaggedShard`` in ``placements``, or ``None``.

    Args:
        placements: a DTensor's placements, one per mesh dim.

    Returns:
        The mesh dim, or ``None`` when no placement is a ``RaggedShard``.
    """
    found = find_ragged(placements)
    return None if found is None else found[0]
