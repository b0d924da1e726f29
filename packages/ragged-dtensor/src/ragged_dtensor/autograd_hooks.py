"""The backward of ``DTensor.to_local`` for RaggedShard DTensors.

torch's ``to_local`` backward rebuilds the gradient's global stride from the local gradient
with a C++ helper that rejects unknown placements (``placement type RaggedShard not
supported!``). A RaggedShard local tensor is a flat run whose global shape cannot be derived
from it anyway, so for RaggedShard the gradient DTensor simply takes the forward DTensor's
global shape and stride (what torch does whenever they match); other DTensors keep torch's
backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._api import _ToTorchTensor

from ragged_dtensor.placement import RaggedShard

_ORIGINAL_BACKWARD = getattr(_ToTorchTensor.backward, "torch_original", _ToTorchTensor.backward)


def _to_local_backward(ctx: Any, grad_output: torch.Tensor | None) -> tuple[DTensor | None, None]:
    spec = ctx.dtensor_spec
    if grad_output is None or not any(isinstance(p, RaggedShard) for p in spec.placements):
        return _ORIGINAL_BACKWARD(ctx, grad_output)
    placements = ctx.grad_placements
    if placements is None:
        placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    grad = DTensor.from_local(
        grad_output, spec.mesh, placements, shape=spec.shape, stride=spec.stride, run_check=False
    )
    return grad, None


_to_local_backward.torch_original = _ORIGINAL_BACKWARD


def install() -> None:
    """Route ``to_local``'s backward for RaggedShard DTensors through :func:`_to_local_backward`."""
    _ToTorchTensor.backward = staticmethod(_to_local_backward)
