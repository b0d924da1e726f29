"""How fsdp makes its DBuffers and the sharded parameters over them (one place for both,
used at ``fully_shard`` time and again when ``model.to(dtype)`` needs a new buffer)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
import torch.nn as nn
from dbuffer import DBuffer
from layout_planner import Plan
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy


def buffer_dtypes(dtype: torch.dtype,
                  mp_policy: MixedPrecisionPolicy) -> tuple[torch.dtype, torch.dtype]:
    """The compute and reduce dtypes of a buffer whose master copy is in ``dtype``. Integer
    and bool tensors are never cast, as in FSDP2: mixed precision is for floating-point
    parameters."""
    floating = dtype.is_floating_point
    compute = (mp_policy.param_dtype if floating else None) or dtype
    return compute, (mp_policy.reduce_dtype if floating else None) or compute


def make_buffer(plan: Plan, mesh: DeviceMesh, *, device: torch.device, dtype: torch.dtype,
                mp_policy: MixedPrecisionPolicy, requires_grad: Collection[str],
                full_tensors: Mapping[str, torch.Tensor] | None = None) -> DBuffer:
    """A DBuffer for ``plan``: master copy in ``dtype``, compute and reduction in the
    policy's dtypes (:func:`buffer_dtypes`), gradients for the tensors in ``requires_grad``;
    filled from ``full_tensors`` (each rank keeps its runs) when given."""
    compute, reduce = buffer_dtypes(dtype, mp_policy)
    every = set(requires_grad) == {e.name for e in plan.entries}
    kwargs = dict(device=device, dtype=dtype, compute_dtype=compute, reduce_dtype=reduce,
                  requires_grad=None if every else tuple(requires_grad))
    if full_tensors is None:
        return DBuffer(plan, mesh, **kwargs)
    return DBuffer.from_tensors(full_tensors, plan, mesh, **kwargs)


def sharded_parameter(buffer: DBuffer, name: str, requires_grad: bool) -> nn.Parameter:
    """An ``nn.Parameter`` RaggedShard DTensor whose local tensor is the buffer's own view,
    so optimizer steps write into the sharded buffer."""
    param = nn.Parameter(buffer.sharded_param(name), requires_grad=requires_grad)
    param._local_tensor = buffer.local_view(name)
    return param
