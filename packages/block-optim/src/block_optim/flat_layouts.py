"""Where a parameter's row-major flat elements lie along the mesh dimension its matrices
are exchanged on.

Muon and Shampoo work on flat runs: each rank holds one contiguous range of a parameter's
row-major elements. A parameter whose placements shard at most one mesh dimension with a
flat-contiguous placement (``RaggedShard``, ``Shard(0)``; the others ``Replicate``, e.g.
HSDP's ``(Replicate(), RaggedShard(...))``) is read directly as such a range on that mesh
dimension (:func:`flat_placement`). Any other placement of torch's (e.g. ``Shard(1)``), and a
RaggedShard beside tensor-parallel ``Shard`` placements (fsdp over TP: a matrix spans the TP
ranks), is gathered to every rank around the step (:func:`to_flat` / :func:`from_flat`),
which costs one all-gather per input tensor.

The owner exchange runs along one mesh dimension only; every coordinate of the other
(replicated) dimensions holds the same values and runs the same exchange, so replicas compute
bit-identical results without talking to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ragged_dtensor import from_local_run, is_ragged
from ragged_dtensor.composed import is_composed
from ragged_dtensor.flat_layout import FlatLayout
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from block_optim.alignment import flat_cuts

__all__ = ["FlatPlacement", "exchange_dim", "flat_placement", "from_flat", "to_flat"]


@dataclass(frozen=True)
class FlatPlacement:
    """How the whole-matrix optimizers read one parameter.

    Attributes:
        mesh_dim: The mesh dimension the owner exchange runs on (:func:`exchange_dim`);
            ``None`` for a plain tensor.
        layout: Where the flat elements lie on the ranks of ``mesh_dim`` (replicated for a
            plain, replicated or gathered parameter).
        gathered: True when the placement is not read directly and the step gathers the
            tensor to every rank (:func:`to_flat`) and slices the result back (:func:`from_flat`).
    """

    mesh_dim: int | None
    layout: FlatLayout
    gathered: bool = False


def flat_placement(param: torch.Tensor, name: str) -> FlatPlacement:
    """Read a parameter's placements as a :class:`FlatPlacement`.

    Args:
        param: A plain tensor or a DTensor on a mesh of any dimension.
        name: The parameter's name, for errors.

    Returns:
        Its flat placement.

    A RaggedShard beside tensor-parallel ``Shard`` placements (fsdp over TP) is gathered:
    its matrices span the TP ranks, so no rank can own one as a flat run of its own.

    Raises:
        NotImplementedError: For a ``RaggedShard`` layout that is not one flat run per rank
            and not composed with TP (a second RaggedShard mesh dimension); raised on every
            rank (placements are global).
    """
    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        return FlatPlacement(None, FlatLayout(shape, 1, replicated=True))
    mesh = param.device_mesh
    cuts = flat_cuts(param)
    if cuts is None and is_ragged(param) and not is_composed(param.placements):
        raise NotImplementedError(
            f"parameter '{name}' has placements {tuple(param.placements)}: whole-matrix "
            "optimizers need at most one sharded mesh dimension next to a RaggedShard"
        )
    dim = exchange_dim(param)
    if cuts is None or cuts.mesh_dim is None:
        return FlatPlacement(dim, FlatLayout(shape, mesh.size(dim), replicated=True), gathered=cuts is None)
    return FlatPlacement(dim, FlatLayout(shape, mesh.size(dim), bounds=cuts.bounds))


def exchange_dim(param: torch.Tensor) -> int | None:
    """The mesh dimension a parameter's matrices are exchanged on: its one sharded mesh
    dimension, else (replicated, or sharded on several) the mesh's last; ``None`` for a plain
    tensor. Cheap (placements only), so the scheduler can group parameters every step.

    Args:
        param: A plain tensor or a DTensor.

    Returns:
        The mesh dimension, or ``None``.
    """
    if not isinstance(param, DTensor):
        return None
    sharded = [d for d, p in enumerate(param.placements) if not isinstance(p, Replicate)]
    return sharded[0] if len(sharded) == 1 else param.device_mesh.ndim - 1


def to_flat(param: torch.Tensor, placement: FlatPlacement, local: torch.Tensor) -> torch.Tensor:
    """This rank's flat input for a parameter: its local run, or the gathered whole tensor.

    Args:
        param: The parameter (gives the mesh, placements and global shape).
        placement: Its flat placement.
        local: This rank's local tensor of the same placement (an update, a gradient).

    Returns:
        A 1-D tensor covering ``placement.layout.local_range(coordinate)``.
    """
    if not placement.gathered:
        return local.reshape(-1)
    whole = from_local_run(local, param.device_mesh, param.placements, param.shape)
    return whole.full_tensor().reshape(-1)


def from_flat(param: torch.Tensor, placement: FlatPlacement, flat: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_flat`: this rank's local tensor from a flat result.

    Args:
        param: The parameter.
        placement: Its flat placement.
        flat: The 1-D result covering ``placement.layout.local_range(coordinate)``.

    Returns:
        A tensor shaped like the parameter's local tensor.
    """
    if not placement.gathered:
        local_shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
        return flat.view(local_shape)
    if is_ragged(param):  # composed with TP: ragged-dtensor cuts the run out, no collective
        mesh = param.device_mesh
        whole = DTensor.from_local(flat.view(param.shape), mesh, [Replicate()] * mesh.ndim,
                                   run_check=False)
        return whole.redistribute(mesh, param.placements).to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    block = flat.view(param.shape)
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        block = block.narrow(dim, start, size)
    return block.contiguous()
