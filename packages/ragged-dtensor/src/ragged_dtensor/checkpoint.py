"""``torch.distributed.checkpoint`` (DCP) hooks for RaggedShard DTensors.

DCP asks each DTensor three things: which boxes of the global tensor it writes
(``__create_write_items__``), which boxes it wants on load (``__create_chunk_list__``), and the
local tensor backing one box (``__get_tensor_shard__``). torch answers from
``compute_local_shape_and_global_offset``, which ignores placements it does not know, so for
a RaggedShard every rank would claim the whole tensor (silently wrong). Here each rank answers
with its own flat run split into the fewest N-D boxes (:mod:`ragged_dtensor.flat_boxes`), each
box an ``as_strided`` view of the 1-D local tensor: saving gathers nothing and loading writes
straight into the local run. Since the boxes are ordinary DCP chunks, a checkpoint saved from
one layout loads into any other placement, world size or ``local_units``, and a RaggedShard
DTensor loads from checkpoints written by any other layout.

On an HSDP mesh ``(Replicate(), RaggedShard(...))`` the replicas write identical items and
DCP's planner keeps one copy of each. Beside tensor-parallel ``Shard`` placements
(:mod:`ragged_dtensor.composed`) the run is one of the TP-local tensor: its boxes are cut in
that shape and moved to where this rank's TP-local tensor lies in the global one (its TP
origin: with an uneven TP cut, ``torch.chunk``'s), so a checkpoint saved at one (dp, tp)
layout loads at any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from ragged_dtensor.composed import is_tp_shard, tp_box
from ragged_dtensor.flat_boxes import Box, box_first_index, box_strides, flat_range_boxes
from ragged_dtensor.placement import RaggedShard, find_ragged

def _ragged_placement(dtensor: DTensor) -> tuple[int, RaggedShard] | None:
    """The mesh dim and RaggedShard of ``dtensor``, or ``None`` if it has none.

    Raises:
        ValueError: if another mesh dim is neither ``Replicate`` nor a tensor-parallel
            ``Shard`` (no checkpoint layout for it).
    """
    found = find_ragged(dtensor.placements)
    if found is not None and not all(
        isinstance(p, (Replicate, RaggedShard)) or is_tp_shard(p) for p in dtensor.placements
    ):
        raise ValueError(
            f"checkpointing a RaggedShard DTensor needs every other mesh dim to be Replicate "
            f"or Shard, got placements {dtensor.placements}"
        )
    return found


@lru_cache(maxsize=4096)
def _cached_boxes(shape: tuple[int, ...], start: int, end: int) -> tuple[Box, ...]:
    return tuple(flat_range_boxes(shape, start, end))


@dataclass(frozen=True)
class LocalBoxes:
    """Where a rank's run of a RaggedShard DTensor lies.

    Attributes:
        boxes: the fewest ``(offsets, sizes)`` boxes covering the run, in the coordinates of
            ``inner`` (the shape the RaggedShard cuts: the TP-local tensor beside
            tensor-parallel ``Shard`` placements, else the global shape).
        inner: that shape.
        origin: where ``inner`` starts in the global tensor (zeros without TP).
        start: the run's first flat index in ``inner``.
    """

    boxes: tuple[Box, ...]
    inner: tuple[int, ...]
    origin: tuple[int, ...]
    start: int

    def global_offsets(self, box: Box) -> tuple[int, ...]:
        """``box``'s offsets in the global tensor."""
        return tuple(o + b for o, b in zip(self.origin, box[0]))


def local_boxes(dtensor: DTensor) -> LocalBoxes:
    """This rank's boxes of a RaggedShard DTensor (beside ``Replicate`` or tensor-parallel
    ``Shard`` placements).

    Args:
        dtensor: a DTensor with a RaggedShard placement.

    Returns:
        The boxes, in the TP-local shape, and where that shape lies in the global tensor.
    """
    found = _ragged_placement(dtensor)
    assert found is not None
    mesh_dim, placement = found
    mesh, placements, shape = dtensor.device_mesh, dtensor.placements, tuple(dtensor.shape)
    coordinate = [mesh.get_local_rank(dim) for dim in range(mesh.ndim)]
    origin, inner = tp_box(mesh, placements, shape, coordinate)
    start, end = placement.flat_range(inner, coordinate[mesh_dim])
    return LocalBoxes(_cached_boxes(inner, start, end), inner, origin, start)


def _box_view(dtensor: DTensor, where: LocalBoxes, box: Box) -> torch.Tensor:
    """The box as a view of the 1-D local run (writes land in the DTensor's storage).

    Raises:
        ValueError: if the local tensor is not contiguous (a RaggedShard local run must be).
    """
    local = dtensor._local_tensor
    if not local.is_contiguous():
        raise ValueError(
            f"RaggedShard DTensor of shape {tuple(dtensor.shape)} has a non-contiguous local "
            f"tensor (stride {local.stride()}); checkpointing needs the contiguous 1-D run"
        )
    return local.as_strided(
        box[1],
        box_strides(where.inner),
        local.storage_offset() + box_first_index(where.inner, box) - where.start,
    )


def _create_write_items(self: DTensor, fqn: str, object: Any) -> list[WriteItem]:
    self._raise_if_contains_partial_placements()
    where = local_boxes(self)
    properties = TensorProperties.create_from_tensor(self._local_tensor)
    items = []
    for box in where.boxes:
        offsets = torch.Size(where.global_offsets(box))
        items.append(WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box[1])),
                properties=properties,
                size=self.size(),
            ),
        ))
    return items


def _create_chunk_list(self: DTensor) -> list[ChunkStorageMetadata]:
    self._raise_if_contains_partial_placements()
    where = local_boxes(self)
    return [
        ChunkStorageMetadata(offsets=torch.Size(where.global_offsets(box)),
                             sizes=torch.Size(box[1]))
        for box in where.boxes
    ]


def _get_tensor_shard(self: DTensor, index: MetadataIndex) -> torch.Tensor:
    self._raise_if_contains_partial_placements()
    where = local_boxes(self)
    for box in where.boxes:
        if index.offset is not None and tuple(index.offset) == where.global_offsets(box):
            return _box_view(self, where, box)
    raise ValueError(
        f"checkpoint item {index.fqn!r}: no box at offset {index.offset} in this rank's part "
        f"of the RaggedShard DTensor (boxes {[where.global_offsets(b) for b in where.boxes]})"
    )


_RAGGED_HOOKS = {
    "__create_write_items__": _create_write_items,
    "__create_chunk_list__": _create_chunk_list,
    "__get_tensor_shard__": _get_tensor_shard,
}


def patched_hook(original: Any) -> Any:
    """The :mod:`ragged_dtensor.torch_patches` factory of DTensor's three DCP hooks: the
    ragged hook for a RaggedShard DTensor, torch's for every other."""
    ragged_hook = _RAGGED_HOOKS[original.__name__]

    def hook(self: DTensor, *args: Any) -> Any:
        if _ragged_placement(self) is not None:
            return ragged_hook(self, *args)
        return original(self, *args)

    hook.__name__ = original.__name__
    hook.__qualname__ = original.__qualname__
    hook.__doc__ = original.__doc__
    return hook
