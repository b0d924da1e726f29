"""Where a parameter's row-major flat elements lie on the ranks of its mesh.

Muon and Shampoo work on flat runs: each rank holds one contiguous range of a parameter's
row-major elements. ``RaggedShard``, ``Shard(0)`` and ``Replicate`` on a 1-D mesh are read
directly as such a range (:func:`flat_layout`); any other placement on a 1-D mesh (e.g.
``Shard(1)``) is gathered to every rank around the step (:func:`to_flat` / :func:`from_flat`),
which costs one all-gather per input tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from block_optim.alignment import flat_cuts

__all__ = ["FlatLayout", "flat_layout", "from_flat", "to_flat"]


@dataclass(frozen=True)
class FlatLayout:
    """Where one parameter's row-major flat elements lie on the ranks of its mesh.

    Attributes:
        numel: The parameter's global element count.
        bounds: ``world_size + 1`` offsets, rank ``r`` holding ``[bounds[r], bounds[r+1])``;
            ``None`` when every rank holds every element (a plain tensor or ``Replicate``).
        gathered: True when the placement is not read directly and the step gathers the
            tensor to every rank (``to_flat``) and slices the result back (``from_flat``).
    """

    numel: int
    bounds: tuple[int, ...] | None
    gathered: bool = False

    def local_range(self, rank: int) -> tuple[int, int]:
        """The flat range ``[start, end)`` rank ``rank`` holds."""
        if self.bounds is None:
            return 0, self.numel
        return self.bounds[rank], self.bounds[rank + 1]


def flat_layout(param: torch.Tensor, name: str) -> FlatLayout:
    """Read a parameter's placement as a :class:`FlatLayout`.

    Flat-contiguous layouts (``RaggedShard``, ``Shard(0)``, ``Replicate``; see
    :func:`block_optim.alignment.flat_cuts`) are read directly; any other placement is gathered
    around the step.

    Args:
        param: A plain tensor or a DTensor on a 1-D mesh.
        name: The parameter's name, for errors.

    Returns:
        The layout.

    Raises:
        NotImplementedError: For a DTensor on a mesh of more than one dimension.
    """
    numel = param.numel()
    if not isinstance(param, DTensor):
        return FlatLayout(numel, None)
    if param.device_mesh.ndim != 1:
        raise NotImplementedError(
            f"parameter '{name}' lives on a {param.device_mesh.ndim}-D mesh; whole-matrix "
            "optimizers support DTensor parameters on 1-D meshes"
        )
    cuts = flat_cuts(param)
    if cuts is None:
        return FlatLayout(numel, None, gathered=True)
    return FlatLayout(numel, None if cuts.mesh_dim is None else cuts.bounds)


def to_flat(param: torch.Tensor, layout: FlatLayout, local: torch.Tensor) -> torch.Tensor:
    """This rank's flat input for a parameter: its local run, or the gathered whole tensor.

    Args:
        param: The parameter (gives the mesh, placements and global shape).
        layout: Its flat layout.
        local: This rank's local tensor of the same placement (an update, a gradient).

    Returns:
        A 1-D tensor covering ``layout.local_range(rank)``.
    """
    if not layout.gathered:
        return local.reshape(-1)
    whole = DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
        run_check=False,
    )
    return whole.full_tensor().reshape(-1)


def from_flat(param: torch.Tensor, layout: FlatLayout, flat: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_flat`: this rank's local tensor from a flat result.

    Args:
        param: The parameter.
        layout: Its flat layout.
        flat: The 1-D result covering ``layout.local_range(rank)``.

    Returns:
        A tensor shaped like the parameter's local tensor.
    """
    local_shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
    if not layout.gathered:
        return flat.view(local_shape)
    (placement,) = param.placements
    mesh = param.device_mesh
    chunks = torch.chunk(flat.view(param.shape), mesh.size(), dim=placement.dim)
    coordinate = mesh.get_local_rank()
    return chunks[coordinate].contiguous() if coordinate < len(chunks) else flat.new_empty(local_shape)
