"""Do a sharded parameter's rank cuts fall on whole units? If not, where should they fall?

Block optimizers compute on fixed units of the flattened tensor (256-element quantization
blocks for 8-bit Adam, whole matrices or preconditioner blocks for Muon and Shampoo). A rank
can run the math on its local shard alone exactly when every rank boundary inside the tensor
is a multiple of the unit. These helpers answer that from global facts only (shape, placements,
mesh size), so every rank reaches the same verdict without communication, and build the
nearest aligned ``RaggedShard`` layout to redistribute a misaligned parameter to.

Only the mesh dimension that shards the tensor matters; ``Replicate`` dimensions cut nothing.
A layout is *flat-contiguous* when every rank of the sharded mesh dimension holds one
contiguous range of the row-major flattened tensor: ``RaggedShard``, and ``Shard(d)`` whose
leading dims ``shape[:d]`` have a single element. Anything else (``Shard(1)`` of a matrix,
``Partial``, two sharded mesh dims) is never aligned.

A ``RaggedShard`` beside tensor-parallel ``Shard`` placements (fsdp over TP,
:mod:`ragged_dtensor.composed`) cuts each rank's *TP-local* tensor, never the global one. An
elementwise optimizer whose units are blocks of the flattened tensor (8-bit Adam) can treat
each TP-local tensor as a tensor of its own: :func:`tp_local_cuts` gives the RaggedShard's cuts
of it (the TP placements cut nothing further inside it), and :func:`aligned_cuts` aligns them,
keeping the TP placements. Whole-matrix optimizers must not: a TP-local tensor is a piece of
their matrix (they ask :func:`flat_cuts`, which has no flat cuts for such a layout).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from ragged_dtensor import RaggedShard
from ragged_dtensor.composed import is_composed, is_tp_shard, ragged_shape
from ragged_dtensor.flat_layout import FlatLayout
from ragged_dtensor.placement import find_ragged
from ragged_dtensor.ragged_math import chunk_bounds


@dataclass(frozen=True)
class FlatCuts:
    """How a DTensor's elements are split over its mesh, in flat (row-major) element offsets.

    Attributes:
        mesh_dim: the mesh dimension that shards the tensor, or ``None`` when every placement
            is ``Replicate``.
        bounds: ``mesh.size(mesh_dim) + 1`` offsets from 0 to numel; coordinate ``r`` on
            ``mesh_dim`` holds flat ``[bounds[r], bounds[r + 1])``. ``(0, numel)`` when
            replicated.
        shape: the shape the cuts cut: the global shape, or the TP-local shape for
            :func:`tp_local_cuts` of a RaggedShard beside tensor-parallel placements.
    """

    mesh_dim: int | None
    bounds: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the tensor the cuts cut (``shape``)."""
        return math.prod(self.shape)

    @property
    def counts(self) -> tuple[int, ...]:
        """Elements held by each coordinate of the sharded mesh dimension."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    def on_units(self, unit: int) -> bool:
        """Whether every cut strictly inside the tensor is a multiple of ``unit`` elements.

        Args:
            unit: the atomic block in elements, counted from the tensor's first element.

        Returns:
            True when no unit is split between ranks.
        """
        return all(b % unit == 0 for b in self.bounds if 0 < b < self.numel)


def _placement_bounds(placement: Placement, shape: tuple[int, ...], ranks: int) -> tuple[int, ...] | None:
    """Flat bounds of one sharding placement, or None when it is not flat-contiguous."""
    try:
        return FlatLayout.of(placement, shape, ranks).bounds
    except NotImplementedError:
        return None


def flat_cuts(dtensor: DTensor) -> FlatCuts | None:
    """The flat per-rank ranges of a DTensor, or ``None`` when they are not contiguous runs.

    Args:
        dtensor: a DTensor on any mesh.

    Returns:
        Its :class:`FlatCuts`; ``None`` for layouts a rank cannot own as one flat run
        (two sharded mesh dims, ``Shard(d)`` with a non-trivial leading dim, ``Partial``).
    """
    shape = tuple(dtensor.shape)
    numel = math.prod(shape)
    sharded = [(d, p) for d, p in enumerate(dtensor.placements) if not isinstance(p, Replicate)]
    if not sharded:
        return FlatCuts(None, (0, numel), shape)
    if len(sharded) > 1:
        return None
    mesh_dim, placement = sharded[0]
    bounds = _placement_bounds(placement, shape, dtensor.device_mesh.size(mesh_dim))
    return None if bounds is None else FlatCuts(mesh_dim, bounds, shape)


def tp_local_cuts(dtensor: DTensor) -> FlatCuts | None:
    """The flat cuts of the tensor each rank computes on alone, for an elementwise optimizer.

    For a ``RaggedShard`` beside tensor-parallel ``Shard``/``Replicate`` placements (fsdp over
    TP) these are the RaggedShard's cuts of the TP-local tensor (``shape`` the TP-local shape,
    from :func:`ragged_dtensor.composed.ragged_shape`): the TP ``Shard`` dims hand each TP rank
    a tensor of its own and cut nothing inside it. With even TP cuts every TP rank has the
    same TP-local shape, so the cuts are global facts (uneven cuts give each TP coordinate its
    own; :class:`~block_optim.AdamW8bit` refuses them). Any other layout: :func:`flat_cuts`.

    Args:
        dtensor: a DTensor on any mesh.

    Returns:
        The :class:`FlatCuts` of the TP-local tensor (or of the tensor); ``None`` for layouts a
        rank cannot own as one flat run.
    """
    placements = tuple(dtensor.placements)
    if not is_composed(placements):
        return flat_cuts(dtensor)
    mesh_dim, ragged = find_ragged(placements)
    others = [p for d, p in enumerate(placements) if d != mesh_dim]
    if not all(is_tp_shard(p) or isinstance(p, Replicate) for p in others):
        return None
    shape = ragged_shape(dtensor.device_mesh, placements, tuple(dtensor.shape))
    bounds = _placement_bounds(ragged, shape, dtensor.device_mesh.size(mesh_dim))
    return None if bounds is None else FlatCuts(mesh_dim, bounds, shape)


def cuts_on_units(dtensor: DTensor, unit: int) -> bool:
    """Whether each rank of ``dtensor`` holds whole units of ``unit`` flattened elements.

    Args:
        dtensor: a DTensor.
        unit: unit size in elements (counted from the first element of the tensor; the last
            unit may be short).

    Returns:
        True when the layout is flat-contiguous and no rank boundary splits a unit (always
        true for a replicated tensor).
    """
    cuts = flat_cuts(dtensor)
    return cuts is not None and cuts.on_units(unit)


def aligned_bounds(bounds: Sequence[int], unit: int, numel: int) -> tuple[int, ...]:
    """Move every interior cut to the nearest multiple of ``unit`` (ties down), keeping order.

    Rounding each cut to its nearest multiple moves at most ``unit / 2`` elements per
    boundary, so the aligned layout is the closest one to the current layout and a
    redistribution to it moves little data. Ranks may end up with no elements.

    Args:
        bounds: non-decreasing cuts from 0 to ``numel`` (or any per-rank split to start from).
        unit: the unit in elements.
        numel: elements of the tensor.

    Returns:
        Cuts of the same length from 0 to ``numel``, interior ones multiples of ``unit``.
    """
    if unit < 1:
        raise ValueError(f"unit must be a positive number of elements, got {unit}")

    def nearest(b: int) -> int:
        down = b // unit * unit
        up = min(numel, down + unit)        # the tensor's end is a valid cut too
        return up if up - b < b - down else down

    inner = [nearest(b) for b in bounds[1:-1]]
    return (0, *inner, numel)


def aligned_ragged_shard(shape: Sequence[int], bounds: Sequence[int]) -> RaggedShard:
    """The ``RaggedShard`` of a tensor of ``shape`` whose rank ``r`` owns ``[bounds[r], bounds[r+1])``.

    Args:
        shape: the global shape.
        bounds: per-rank flat cuts from 0 to numel.

    Returns:
        The placement (shortest ``dims`` prefix for which every piece is whole rows).
    """
    return RaggedShard.from_element_counts(
        tuple(shape), [b - a for a, b in zip(bounds, bounds[1:])]
    )


def aligned_cuts(dtensor: DTensor, unit: int) -> FlatCuts:
    """The block-aligned layout closest to ``dtensor``'s: the redistribution target for a
    misaligned parameter, as flat cuts.

    The current cuts are moved to the nearest unit boundary (:func:`aligned_bounds`); a layout
    that is not flat-contiguous starts from an even split of the flattened tensor. An aligned
    layout is returned unchanged. A RaggedShard beside tensor-parallel placements is aligned
    on its TP-local tensor (:func:`tp_local_cuts`): only the ragged mesh dim's cuts move.

    Args:
        dtensor: the DTensor to align.
        unit: unit size in elements.

    Returns:
        The aligned :class:`FlatCuts` on the sharded mesh dimension.

    Raises:
        ValueError: if more than one mesh dimension shards the tensor (a RaggedShard beside
            tensor-parallel ``Shard`` placements excepted).
    """
    cuts = tp_local_cuts(dtensor)
    if cuts is not None:
        if cuts.on_units(unit):
            return cuts
        return FlatCuts(cuts.mesh_dim, aligned_bounds(cuts.bounds, unit, cuts.numel), cuts.shape)
    sharded = [d for d, p in enumerate(dtensor.placements) if not isinstance(p, Replicate)]
    if len(sharded) != 1:
        raise ValueError(
            f"cannot align a tensor sharded on {len(sharded)} mesh dims "
            f"(placements {tuple(dtensor.placements)}); shard it on one mesh dim, or put a "
            "RaggedShard beside tensor-parallel Shard/Replicate placements"
        )
    shape = tuple(dtensor.shape)
    start = chunk_bounds(math.prod(shape), dtensor.device_mesh.size(sharded[0]))
    return FlatCuts(sharded[0], aligned_bounds(start, unit, math.prod(shape)), shape)


def placements_for(dtensor: DTensor, cuts: FlatCuts) -> tuple[Placement, ...]:
    """``dtensor``'s placements with its sharded mesh dimension replaced by the RaggedShard of
    ``cuts`` (``Replicate`` and tensor-parallel ``Shard`` dimensions stay).

    Args:
        dtensor: the DTensor (gives the other mesh dims' placements).
        cuts: the flat cuts to realise, e.g. from :func:`aligned_cuts`.

    Returns:
        One placement per mesh dimension.
    """
    placements = list(dtensor.placements)
    if cuts.mesh_dim is not None:
        placements[cuts.mesh_dim] = aligned_ragged_shard(cuts.shape, cuts.bounds)
    return tuple(placements)


def aligned_placements(dtensor: DTensor, unit: int) -> tuple[Placement, ...]:
    """Placements for ``dtensor`` whose cuts fall on whole units (``placements_for`` of
    :func:`aligned_cuts`); the target to redistribute a misaligned parameter to.

    Args:
        dtensor: the DTensor to align.
        unit: unit size in elements.

    Returns:
        One placement per mesh dimension.
    """
    return placements_for(dtensor, aligned_cuts(dtensor, unit))


_WARNED: set[tuple[str, str]] = set()


def warn_once(topic: str, name: str, message: str) -> None:
    """Emit ``message`` as a ``UserWarning`` the first time ``(topic, name)`` is seen in this
    process.

    Used to say, once per parameter, that a misaligned parameter is being redistributed every
    step (a performance hazard worth one line in the log, not one per step).

    Args:
        topic: what the warning is about (e.g. ``"AdamW8bit realign"``).
        name: the parameter's name, included in the message.
        message: the text after the name.
    """
    if (topic, name) in _WARNED:
        return
    _WARNED.add((topic, name))
    warnings.warn(f"{topic}: parameter '{name}' {message}", UserWarning, stacklevel=3)
