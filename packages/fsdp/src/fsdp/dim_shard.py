"""Parameters FSDP2's ``shard_placement_fn`` cuts along a dim ``d > 0``, with no copy.

``Shard(d)`` gives every rank an equal chunk of the parameter along ``d`` (FSDP2 supports only
even chunks there, and so does fsdp, with FSDP2's error). Such a chunk is not a run of the
flattened tensor, so fsdp stores the parameter *dim-permuted*: dim ``d`` first
(``param.movedim(d, 0)``), where the same chunk is a run of whole rows. Each such parameter gets
a buffer of its own, planned one chunk per rank, so that:

* the sharded parameter is a ``Shard(d)`` DTensor (``(Replicate(), Shard(d))`` on an HSDP
  mesh) whose local tensor is the rank's run seen through ``movedim(0, d)``: a view of the
  sharded buffer, shaped like FSDP2's local shard;
* the unsharded parameter, and its ``.grad``, are the unsharded buffers' views seen the same
  way, so the all-gather and the reduce-scatter stay zero-copy (FSDP2 copies a ``Shard(d > 0)``
  parameter out of its all-gather output and its gradient into the reduce-scatter input).

A tensor-parallel parameter is cut the same way along a dim of its TP-local tensor that tensor
parallelism leaves whole (FSDP2's 2-D pattern: ``Shard(1)`` over dp for a ``ColwiseParallel``
weight), with placements ``(Shard(d), *tp_placements)`` on the combined mesh; a dim TP already
cuts (FSDP2's ``_StridedShard``) raises.

The price of the view is the stride: these tensors are not contiguous (the unsharded
parameter is laid out like the transpose of a contiguous one for a 2-D weight). Matmuls take
such operands as they are; code that needs a contiguous tensor calls ``.contiguous()``. A
buffer per parameter is one all-gather and one reduce-scatter more per such parameter.

One consumer would get the stride wrong silently: torch's fused optimizer kernels
(``fused=True``) walk a parameter, its gradient and its states as flat memory, so a state laid
out differently from its parameter pairs the wrong elements. States the optimizer creates
itself (``zeros_like``) keep the parameter's strides, but a loaded one need not (a full state
dict distributes contiguous chunks). So while such parameters exist, a global optimizer
step pre-hook (:func:`align_optimizer_states`) lays every state of one of them out like the
parameter before each step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from dbuffer import DBuffer
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdp.managed_param import ManagedParam
from fsdp.tensor_parallel import TPLayout, TPManagedParam


@dataclass(frozen=True)
class DimShard:
    """How a ``Shard(dim)`` parameter (``dim > 0``) is stored.

    Attributes:
        dim: the dim the chunks are cut along.
        shape: the shape before the permutation: the parameter's (its TP-local tensor's for a
            tensor-parallel one).
    """

    dim: int
    shape: tuple[int, ...]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape fsdp stores and plans: ``dim`` first."""
        rest = [s for i, s in enumerate(self.shape) if i != self.dim]
        return (self.shape[self.dim], *rest)

    def stored(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (shaped like the parameter or a chunk of it) in the stored order: a
        view, flattened only by the caller (``reshape``)."""
        return tensor.movedim(self.dim, 0)

    def logical(self, flat: torch.Tensor) -> torch.Tensor:
        """A stored run of whole rows (a 1-D view, or one shaped like :attr:`stored_shape`)
        seen in the parameter's order: a view of the same memory."""
        rows = flat.numel() // math.prod(self.stored_shape[1:])
        return flat.view(rows, *self.stored_shape[1:]).movedim(0, self.dim)


def shard_dims(named: list[tuple[str, nn.Parameter]],
               shard_placement_fn: Callable[[nn.Parameter], object] | None,
               mesh: DeviceMesh) -> tuple[dict[str, int], dict[str, DeviceMesh]]:
    """The dim and the mesh FSDP2's ``shard_placement_fn`` asks to shard each parameter
    along and over (0 and ``mesh`` for ``None``), calling it once per parameter. A
    ``ShardPlacementResult`` (torch 2.13) gives both: its mesh may be another than ``mesh``
    (FSDP2's expert pattern: experts sharded over an ``efsdp`` mesh beside their ``ep``
    mesh), and the parameter then lives in buffers of that mesh within the same group.

    Args:
        named: the group's parameters with their names (for error messages).
        shard_placement_fn: FSDP2's placement hook, or ``None``.
        mesh: ``fully_shard``'s data-parallel mesh.

    Returns:
        For every name, the dim as given (checked, in parameter order with the other
        per-parameter checks, by :func:`checked_dim`), and the mesh to shard over.

    Raises:
        NotImplementedError: for a placement other than ``Shard``, or a
            ``ShardPlacementResult`` whose mesh fsdp cannot shard over (see
            :func:`_result_mesh`).
    """
    dims: dict[str, int] = {}
    meshes: dict[str, DeviceMesh] = {}
    for name, param in named:
        placement = shard_placement_fn(param) if shard_placement_fn is not None else None
        meshes[name] = mesh
        if hasattr(placement, "mesh_info"):  # ShardPlacementResult, torch 2.13
            meshes[name] = _result_mesh(name, placement.mesh_info, mesh)  # type: ignore[union-attr]
            placement = placement.placement  # type: ignore[union-attr]
        if placement is None:
            dims[name] = 0
            continue
        if not isinstance(placement, Shard):
            raise NotImplementedError(
                f"shard_placement_fn returned {placement!r} for parameter {name!r}: only None, "
                "Shard(d) or a ShardPlacementResult are supported")
        dims[name] = placement.dim
    return dims, meshes


def checked_dim(param: torch.Tensor, dim: int) -> int:
    """``dim`` (from :func:`shard_dims`) in ``[0, param.dim())``, a negative one counted from
    the end, as FSDP2 reads it.

    Raises:
        AssertionError: for a dim ``param`` does not have (FSDP2's error and words).
    """
    normalized = dim + param.dim() if dim < 0 else dim
    if not 0 <= normalized < param.dim():
        raise AssertionError(f"Shard dim {dim} is invalid for {param.dim()}D tensor: "
                             f"{tuple(param.shape)}")
    return normalized


def _result_mesh(name: str, mesh_info: Any, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of a ``ShardPlacementResult``'s ``mesh_info`` (FSDP2's ``FSDPMeshInfo`` /
    ``HSDPMeshInfo``), which must describe it as fsdp shards over a mesh: a 1-D mesh, or a
    named 2-D one with the replicate dim first, on ``mesh``'s device type."""
    own = mesh_info.mesh
    replicate = getattr(mesh_info, "replicate_mesh_dim", None)
    if (own.device_type != mesh.device_type or own.ndim not in (1, 2)
            or mesh_info.shard_mesh_dim != own.ndim - 1
            or replicate != (0 if own.ndim == 2 else None)
            or (own.ndim == 2 and own.mesh_dim_names is None)):
        raise NotImplementedError(
            f"shard_placement_fn returned a ShardPlacementResult for parameter {name!r} on "
            f"{own} (shard dim {mesh_info.shard_mesh_dim}, replicate dim {replicate}): fsdp "
            f"shards over a 1-D mesh, or a named 2-D (replicate, shard) mesh, on "
            f"{mesh.device_type} as fully_shard's mesh {mesh}")
    return own


def check_even(name: str, param: torch.Tensor, dim: int, shard_size: int) -> None:
    """Raise FSDP2's error for a ``Shard(dim > 0)`` whose chunks would be uneven.

    Raises:
        NotImplementedError: when ``param.size(dim)`` is not a multiple of ``shard_size``.
    """
    if param.size(dim) % shard_size != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {tuple(param.shape)} "
            f"(world size: {shard_size}); parameter {name!r}")


_DIM_FIRST_ATTR = "_fsdp_dim_first"
_step_hook: RemovableHandle | None = None


def align_optimizer_states(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before any optimizer step: give the gradient and each state of a dim-first parameter
    (a tensor of the parameter's shape: Adam's moments, momentum buffers) the parameter's
    local strides, copying the values, where it has others (a state loaded from a full state
    dict, a gradient the user assigned). torch's fused kernels pair elements by memory
    position, so without this a fused step would update the wrong elements. Registered
    once, as a global optimizer step pre-hook
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``), when the first such
    parameter is made; it costs one attribute check per parameter per step.

    Args:
        optimizer: the optimizer about to step.
        args: its step's positional arguments (unused).
        kwargs: its step's keyword arguments (unused).
    """
    del args, kwargs
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not getattr(param, _DIM_FIRST_ATTR, False):
                continue
            local = param._local_tensor
            if _strided_otherwise(param.grad, param):
                param.grad = _aligned(param.grad, local)
            state = optimizer.state.get(param) or {}
            for key, value in state.items():
                if _strided_otherwise(value, param):
                    state[key] = _aligned(value, local)


def _strided_otherwise(value: object, param: nn.Parameter) -> bool:
    """Whether ``value`` is a DTensor of ``param``'s shape whose local strides differ."""
    return (isinstance(value, DTensor) and value.shape == param.shape
            and value._local_tensor.stride() != param._local_tensor.stride())


def _aligned(value: DTensor, like: torch.Tensor) -> DTensor:
    """``value`` with its local tensor copied into ``like``'s strides."""
    local = torch.empty_like(like, dtype=value.dtype)
    local.copy_(value._local_tensor)
    return DTensor(local, value._spec, requires_grad=value.requires_grad)


def _mark_dim_first(param: nn.Parameter) -> None:
    global _step_hook
    setattr(param, _DIM_FIRST_ATTR, True)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(align_optimizer_states)


def sharded_parameter(buffer: DBuffer, name: str, shard: DimShard, requires_grad: bool,
                      layout: TPLayout | None = None) -> nn.Parameter:
    """The registered parameter over ``buffer``'s run of ``name``: a ``Shard(dim)`` DTensor
    (``(Replicate(), Shard(dim))`` on an HSDP mesh; for a tensor-parallel parameter, with
    ``layout``, on the combined mesh with the TP placements after it) whose local tensor is
    the run seen through :meth:`DimShard.logical`, so optimizer steps write into the buffer."""
    local = shard.logical(buffer.local_view(name))
    like = buffer.sharded_param(name)  # the stored tensor's RaggedShard DTensor: its mesh
    dp_placements = (*like.placements[:-1], Shard(shard.dim))
    if layout is not None:
        dtensor = layout.sharded_dtensor(local, dp_placements)
    else:
        meta = TensorMeta(torch.Size(shard.shape), tuple(make_contiguous_strides_for(shard.shape)),
                          local.dtype)
        dtensor = DTensor(local, DTensorSpec(like.device_mesh, dp_placements, tensor_meta=meta),
                          requires_grad=False)
    param = nn.Parameter(dtensor, requires_grad=requires_grad)
    param._local_tensor = local
    _mark_dim_first(param)
    return param


class _DimFirst:
    """What a parameter stored dim-first does differently, whatever else it is: values copied
    into the buffer go dim-first, the buffer's runs come back through :meth:`DimShard.logical`."""

    shard: DimShard | None
    name: str
    buffer: DBuffer
    sharded: nn.Parameter

    @property
    def _shard(self) -> DimShard:
        assert self.shard is not None
        return self.shard

    def _stored(self, value: torch.Tensor) -> torch.Tensor:
        return self._shard.stored(value)

    def local_of(self, view: torch.Tensor) -> torch.Tensor:
        return self._shard.logical(view)

    def sharded_grad(self) -> DTensor:
        """The reduced gradient: the sharded gradient buffer's run, placed like the
        parameter."""
        local = self._shard.logical(self.buffer.sharded_grad_view(self.name))
        return DTensor(local, self.sharded._spec, requires_grad=False)


@dataclass(eq=False)
class DimShardManagedParam(_DimFirst, ManagedParam):
    """A :class:`~fsdp.managed_param.ManagedParam` cut along ``shard.dim > 0``: every tensor
    the module, autograd or the optimizer sees is a buffer view through
    :meth:`DimShard.logical`."""

    shard: DimShard | None = None

    def _as_param_tensor(self, view: torch.Tensor) -> torch.Tensor:
        return self._shard.logical(view)

    def _local(self, grad: torch.Tensor) -> torch.Tensor:
        return self._shard.stored(grad)

    def sharded_on(self, buffer: DBuffer) -> nn.Parameter:
        return sharded_parameter(buffer, self.name, self._shard, self.sharded.requires_grad)


@dataclass(eq=False)
class TPDimShardManagedParam(_DimFirst, TPManagedParam):
    """A tensor-parallel parameter cut along ``shard.dim > 0`` of its TP-local tensor (a dim
    tensor parallelism does not cut): the TP views of
    :class:`~fsdp.tensor_parallel.TPManagedParam` over the dim-first views."""

    shard: DimShard | None = None

    def _logical(self, view: torch.Tensor) -> torch.Tensor:
        return self._shard.logical(view)

    def _local(self, grad: torch.Tensor) -> torch.Tensor:
        return self._shard.stored(self._layout.tp_local(grad))

    def sharded_on(self, buffer: DBuffer) -> nn.Parameter:
        return sharded_parameter(buffer, self.name, self._shard, self.sharded.requires_grad,
                                 self._layout)
