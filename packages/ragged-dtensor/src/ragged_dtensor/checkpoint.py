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
DCP's planner keeps one copy of each.
"""

from __future__ import annotations

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

from ragged_dtensor.flat_boxes import Box, box_first_index, box_strides, flat_range_boxes
from ragged_dtensor.placement import RaggedShard, find_ragged

def _ragged_placement(dtensor: DTensor) -> tuple[int, RaggedShard] | None:
    """The mesh dim and RaggedShard of ``dtensor``, or ``None`` if it has none.

    Raises:
        ValueError: if another mesh dim is not ``Replicate`` (no checkpoint layout for it).
    """
    found = find_ragged(dtensor.placements)
    if found is not None and not all(
        isinstance(p, (Replicate, RaggedShard)) for p in dtensor.placements
    ):
        raise ValueError(
            f"checkpointing a RaggedShard DTensor needs every other mesh dim to be Replicate, "
            f"got placements {dtensor.placements}"
        )
    return found


@lru_cache(maxsize=4096)
def _cached_boxes(shape: tuple[int, ...], start: int, end: int) -> tuple[Box, ...]:
    return tuple(flat_range_boxes(shape, start, end))


def local_boxes(dtensor: DTensor) -> tuple[tuple[Box, ...], int]:
    """This rank's boxes of a RaggedShard DTensor and the flat start of its local run.

    Args:
        dtensor: a DTensor with a RaggedShard placement.

    Returns:
        ``(boxes, start)``: the fewest ``(offsets, sizes)`` boxes covering the run, and the
        run's first flat index.
    """
    found = _ragged_placement(dtensor)
    assert found is not None
    mesh_dim, placement = found
    shape = tuple(dtensor.shape)
    coordinate = dtensor.device_mesh.get_local_rank(mesh_dim)
    start, end = placement.flat_range(shape, coordinate)
    return _cached_boxes(shape, start, end), start


def _box_view(dtensor: DTensor, box: Box, start: int) -> torch.Tensor:
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
    shape = tuple(dtensor.shape)
    return local.as_strided(
        box[1],
        box_strides(shape),
        local.storage_offset() + box_first_index(shape, box) - start,
    )


def _create_write_items(self: DTensor, fqn: str, object: Any) -> list[WriteItem]:
    self._raise_if_contains_partial_placements()
    boxes, _ = local_boxes(self)
    properties = TensorProperties.create_from_tensor(self._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=properties,
                size=self.size(),
            ),
        )
        for offsets, sizes in boxes
    ]


def _create_chunk_list(self: DTensor) -> list[ChunkStorageMetadata]:
    self._raise_if_contains_partial_placements()
    boxes, _ = local_boxes(self)
    return [
        ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        for offsets, sizes in boxes
    ]


def _get_tensor_shard(self: DTensor, index: MetadataIndex) -> torch.Tensor:
    self._raise_if_contains_partial_placements()
    boxes, start = local_boxes(self)
    for box in boxes:
        if index.offset is not None and tuple(index.offset) == box[0]:
            return _box_view(self, box, start)
    raise ValueError(
        f"checkpoint item {index.fqn!r}: no box at offset {index.offset} in this rank's part "
        f"of the RaggedShard DTensor (boxes {[b[0] for b in boxes]})"
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
