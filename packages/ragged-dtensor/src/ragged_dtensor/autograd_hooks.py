"""``DTensor.from_local``'s checks and ``DTensor.to_local``'s backward for RaggedShard DTensors.

``from_local`` trusts its input: torch checks nothing about a local tensor's size against its
placements, so a wrong-sized RaggedShard run would be accepted and silently give wrong sums.
For RaggedShard placements :func:`_from_local_forward` first checks that the local tensor is
the rank's run (1-D, contiguous, ``placement.local_numel`` elements) and that the global
shape is given (it cannot be derived from ragged runs). With ``run_check=True`` the check is a
consensus: every rank raises if any rank's run is wrong. With ``run_check=False`` (torch's
promise of no communication) the failing rank raises alone.

torch's ``to_local`` backward rebuilds the gradient's global stride from the local gradient
with a C++ helper that rejects unknown placements (``placement type RaggedShard not
supported!``). A RaggedShard local tensor is a flat run whose global shape cannot be derived
from it anyway, so for RaggedShard the gradient DTensor simply takes the forward DTensor's
global shape and stride (what torch does whenever they match); other DTensors keep torch's
backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor import composed
from ragged_dtensor.consensus import raise_on_any_rank
from ragged_dtensor.placement import find_ragged
from ragged_dtensor.torch_patches import torch_original

_ORIGINAL_BACKWARD = torch_original("torch.distributed.tensor._api._ToTorchTensor.backward")
_ORIGINAL_FORWARD = torch_original("torch.distributed.tensor._api._FromTorchTensor.forward")


def local_run_error(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: Sequence[int] | None,
) -> ValueError | None:
    """Why ``local`` is not this rank's run of a RaggedShard DTensor, or ``None`` if it is.

    Args:
        local: the local tensor passed to ``from_local``.
        mesh: the device mesh.
        placements: the placements, one holding a RaggedShard.
        shape: the global shape passed to ``from_local`` (``None`` if not given).

    Returns:
        A ValueError naming the shape, placement, rank and sizes, or ``None``.
    """
    found = find_ragged(placements)
    assert found is not None
    mesh_dim, placement = found
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not shape:
        return ValueError(
            f"DTensor.from_local with {placement!r} needs the global shape and stride: a ragged "
            f"run does not determine them (rank {rank}, local tensor of {local.numel()} elements)"
        )
    coordinate = mesh.get_local_rank(mesh_dim)
    try:
        shape = composed.ragged_shape(mesh, placements, shape)  # the TP-local shape beside Shard
        placement.check(tuple(shape), mesh.size(mesh_dim))
    except ValueError as error:
        return error
    expected = placement.local_numel(tuple(shape), coordinate)
    if local.dim() != 1 or not local.is_contiguous() or local.numel() != expected:
        return ValueError(
            f"DTensor.from_local: {placement!r} of a tensor of shape {tuple(shape)} gives rank "
            f"{rank} (mesh coordinate {coordinate}) a contiguous 1-D run of {expected} elements, "
            f"but its local tensor has shape {tuple(local.shape)}"
            f"{'' if local.is_contiguous() else ' and is not contiguous'}"
        )
    return None


def _from_local_forward(
    ctx: Any,
    input: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    run_check: bool,
    shape: torch.Size | None = None,
    stride: tuple[int, ...] | None = None,
    grad_placements: tuple[Placement, ...] | None = None,
) -> DTensor:
    if find_ragged(placements) is not None and device_mesh._is_current_rank_part_of_mesh():
        error = local_run_error(input, device_mesh, placements, shape)
        if run_check:
            flat = device_mesh if device_mesh.ndim == 1 else device_mesh._flatten()
            raise_on_any_rank(error, flat.get_group(0))
        elif error is not None:
            raise error
    return _ORIGINAL_FORWARD(
        ctx, input, device_mesh, placements, run_check, shape, stride, grad_placements
    )


def patched_from_local_forward(original: object) -> staticmethod:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``_FromTorchTensor.forward``."""
    return staticmethod(_from_local_forward)


def _to_local_backward(ctx: Any, grad_output: torch.Tensor | None) -> tuple[DTensor | None, None]:
    spec = ctx.dtensor_spec
    if grad_output is None or find_ragged(spec.placements) is None:
        return _ORIGINAL_BACKWARD(ctx, grad_output)
    placements = ctx.grad_placements
    if placements is None:
        placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    grad = DTensor.from_local(
        grad_output.contiguous(), spec.mesh, placements, shape=spec.shape, stride=spec.stride,
        run_check=False,
    )
    return grad, None


def patched_to_local_backward(original: object) -> staticmethod:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``_ToTorchTensor.backward``."""
    return staticmethod(_to_local_backward)
