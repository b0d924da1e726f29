"""fsdp over tensor parallelism: parameters that are already DTensors on a TP mesh.

``parallelize_module(model, world["tp"], plan)`` first, then ``fully_shard(block,
mesh=world["dp"])``, as with FSDP2. fsdp then stores each parameter's *TP-local* tensor (what
TP left on this rank) in its DBuffers and runs its collectives on the data-parallel mesh only:

* planning sees the TP-local shapes, so units (rows of the TP-local tensor by default) never
  cut a TP shard's structure: a ``Shard(1)`` column block stays whole;
* the sharded parameter is a DTensor on the combined mesh (dp dims, then TP dims) with
  placements ``(RaggedShard, *tp_placements)`` (HSDP: ``(Replicate(), RaggedShard, *tp)``),
  its local tensor the DBuffer's view; the RaggedShard cuts the TP-local tensor (see
  :mod:`ragged_dtensor.composed` for that order and where it matches FSDP2's
  ``_StridedShard``), so ``full_tensor()`` and ``redistribute()`` give the right values;
* forward gives each module its unsharded TP-local tensor (a view of the unsharded buffer)
  wrapped in the original TP spec, so ``parallelize_module``'s plans run unchanged;
* backward's gradient buffer is armed as a TP DTensor over the gradient buffer's view:
  autograd adds each gradient into it in place, after DTensor has turned a pending
  (``Partial``) gradient of a TP-replicated parameter into the parameter's placement (one
  all-reduce over TP, as in FSDP2), and the buffer is reduce-scattered over dp only.

Supported TP placements are ``Shard(d)`` and ``Replicate()``; anything else raises
``NotImplementedError`` naming the parameter. A ``Shard(d)`` need not divide evenly (a hidden
size of 201 on 2 TP ranks): TP cuts it as torch does (``torch.chunk``: 101 and 100 rows), so
the TP-local shape depends on the TP coordinate, and each data-parallel group (the ranks that
share a TP coordinate) plans its own buffers over its own TP-local shapes. That is consistent
inside each data-parallel group, which is all fsdp's collectives span; the sharded parameters'
``RaggedShard`` placements then differ between TP coordinates (see
:mod:`ragged_dtensor.composed`). A cut that leaves some TP coordinate no elements at all (a
dim shorter than the TP size asks for) raises ``NotImplementedError`` naming the parameter, on
every rank alike.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn as nn
from dbuffer import DBuffer
from ragged_dtensor.composed import ragged_shape, smallest_tp_numel
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fsdp.managed_param import ManagedParam
from fsdp.spmd_mesh import SPMDMesh, joined

T = TypeVar("T")


@dataclass(frozen=True)
class TPLayout:
    """Where a tensor-parallel parameter lives besides fsdp's data-parallel mesh.

    Attributes:
        param_mesh: the mesh of the parameter as its module sees it: its own (TP) mesh, or
            the full SPMD mesh of ``fully_shard(..., dp_mesh_dims=...)``.
        param_placements: its placements on ``param_mesh``.
        dp_indices: the dims of ``param_mesh`` that are fsdp's, ascending (none on a TP
            mesh; the replicate and shard dims of an SPMD mesh, where the parameter is
            ``Replicate``, wherever they are on it).
        shape: the global shape.
        stride: the global stride.
        local_shape: the TP-local shape (what fsdp plans and stores).
        mesh: the combined mesh: the dp mesh's dims, then the TP mesh's.
    """

    param_mesh: DeviceMesh
    param_placements: tuple[Placement, ...]
    dp_indices: tuple[int, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    local_shape: tuple[int, ...]
    mesh: DeviceMesh

    @functools.cached_property
    def tp_placements(self) -> tuple[Placement, ...]:
        """The placements on the dims that are not fsdp's (read on every gradient aim)."""
        return self.split(self.param_placements)[1]

    def split(self, per_dim: Sequence[T]) -> tuple[tuple[T, ...], tuple[T, ...]]:
        """``per_dim`` (one item per dim of ``param_mesh``: placements, dim names) as (those
        of fsdp's dims, those of the others)."""
        dp = tuple(x for i, x in enumerate(per_dim) if i in self.dp_indices)
        return dp, tuple(x for i, x in enumerate(per_dim) if i not in self.dp_indices)

    def on_param_mesh(self, dp_placements: Sequence[Placement]) -> tuple[Placement, ...]:
        """Placements on ``param_mesh``: ``dp_placements`` on fsdp's dims (in order), the
        parameter's own on the others (the inverse of :meth:`split`)."""
        dp, tp = iter(dp_placements), iter(self.tp_placements)
        return tuple(next(dp) if i in self.dp_indices else next(tp)
                     for i in range(self.param_mesh.ndim))

    def tp_dtensor(self, local: torch.Tensor,
                   dp_placements: Sequence[Placement] | None = None) -> DTensor:
        """``local`` (a TP-local tensor, e.g. a view of an unsharded buffer) as the DTensor
        the module's parameter is (on ``param_mesh``), holding ``local`` itself (no alias);
        ``dp_placements`` replace the parameter's on the data-parallel dims (a gradient's)."""
        meta = TensorMeta(self.shape, self.stride, local.dtype)
        placements = (self.param_placements if dp_placements is None
                      else self.on_param_mesh(dp_placements))
        spec = DTensorSpec(self.param_mesh, placements, tensor_meta=meta)
        return DTensor(local, spec, requires_grad=False)

    def sharded_dtensor(self, local: torch.Tensor, dp_placements: Sequence[Placement]) -> DTensor:
        """``local`` (this rank's ragged run of the TP-local tensor) as a DTensor on the
        combined mesh with placements ``(*dp_placements, *tp_placements)``."""
        meta = TensorMeta(self.shape, self.stride, local.dtype)
        spec = DTensorSpec(self.mesh, (*dp_placements, *self.tp_placements), tensor_meta=meta)
        return DTensor(local, spec, requires_grad=False)

    def tp_local(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient autograd produced for the unsharded parameter, as a TP-local tensor in
        the parameter's TP placements (a pending ``Partial`` is reduced over TP). On an SPMD
        mesh the fsdp dims keep what the gradient has there (``Partial`` or ``Replicate``):
        fsdp's reduce-scatter over them is the reduction, as in FSDP2, not an all-reduce."""
        if not isinstance(grad, DTensor):
            raise TypeError(f"fsdp: expected a DTensor gradient for a tensor-parallel parameter "
                            f"of shape {tuple(self.shape)}, got {type(grad).__name__}")
        target = self.on_param_mesh(self.split(grad.placements)[0])
        if grad.placements != target:
            grad = grad.redistribute(self.param_mesh, target)
        return grad.to_local()


def stored_tensor(param: torch.Tensor) -> torch.Tensor:
    """What fsdp stores of ``param``: its TP-local tensor for a DTensor, else ``param``."""
    return param.to_local().detach() if isinstance(param, DTensor) else param


def plan_layout(name: str, param: DTensor, dp_mesh: DeviceMesh) -> TPLayout:
    """Check that fsdp can shard ``param`` over ``dp_mesh`` and say how.

    Args:
        name: the parameter's name in its group (for errors).
        param: a DTensor parameter (already placed by tensor parallelism).
        dp_mesh: the mesh ``fully_shard`` was given.

    Returns:
        The parameter's layout.

    Raises:
        ValueError: when the meshes do not belong to one world or share a dim.
        NotImplementedError: for TP placements other than ``Shard(d)`` and ``Replicate``, or
            an uneven ``Shard(d)`` that leaves some TP rank no elements (global facts: raised
            on every rank alike).
    """
    tp_mesh = param.device_mesh
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    if dp_names is None or tp_names is None:
        raise ValueError(
            f"fully_shard: parameter {name!r} is a DTensor on mesh {tp_mesh}; composing with "
            "tensor parallelism needs named meshes sliced from one world mesh (e.g. "
            "world['dp'] and world['tp'])")
    if set(dp_names) & set(tp_names):
        raise ValueError(f"fully_shard: parameter {name!r}'s mesh dims {tp_names} overlap "
                         f"fsdp's mesh dims {dp_names}")
    # The combined mesh joins the two: torch checks that they index one world's ranks and
    # cut it along independent dims (slices of one mesh, or of one mesh unflattened: FSDP2's
    # expert pattern puts experts on an ``ep`` dim and shards them over its ``efsdp``
    # partner, both unflattened from the data-parallel dim).
    try:
        combined = joined([dp_mesh, tp_mesh])
    except RuntimeError as error:
        raise ValueError(f"fully_shard: parameter {name!r} lives on {tp_mesh}, which does not "
                         f"join fsdp's mesh {dp_mesh} into one mesh of one world ({error})"
                         ) from None
    return TPLayout(tp_mesh, tuple(param.placements), (), param.shape, tuple(param.stride()),
                    _tp_local_shape(name, param), combined)


def plan_spmd_layout(name: str, param: torch.Tensor, spmd: SPMDMesh) -> TPLayout:
    """:func:`plan_layout` for a parameter of ``fully_shard(..., dp_mesh_dims=...)``: a
    DTensor on the full SPMD mesh, ``Replicate()`` on fsdp's dims (FSDP2's rules; its
    identity check of the mesh is an equality check here). The combined mesh is
    ``spmd.sharded_mesh``.

    Raises:
        ValueError: for a plain tensor, a DTensor on another mesh, or one that is not
            ``Replicate()`` on a data-parallel dim.
        NotImplementedError: as :func:`plan_layout`, for the other dims' placements.
    """
    mesh = spmd.mesh
    if not isinstance(param, DTensor):
        raise ValueError("When dp_mesh_dims is provided, all parameters must be DTensors on "
                         "the full SPMD mesh (e.g. via distribute_module). Got plain tensor for "
                         f"parameter {name!r}.")
    if param.device_mesh != mesh:
        raise ValueError(f"Expected parameter {name!r}'s DTensor mesh to be the mesh passed to "
                         f"fully_shard ({mesh}), but got {param.device_mesh}")
    names = mesh.mesh_dim_names or ()
    for dim in spmd.dp_indices:
        placement = param.placements[dim]
        if not isinstance(placement, Replicate):
            raise ValueError(f"Expected Replicate() on DP dim {names[dim]!r} (index {dim}) of "
                             f"parameter {name!r} but got {placement}")
    return TPLayout(mesh, tuple(param.placements), spmd.dp_indices, param.shape,
                    tuple(param.stride()), _tp_local_shape(name, param), spmd.sharded_mesh)


def _tp_local_shape(name: str, param: DTensor) -> tuple[int, ...]:
    """The TP-local shape of ``param``, after the checks that fsdp can cut it (global facts:
    raised on every rank alike)."""
    for p in param.placements:
        if type(p) not in (Shard, Replicate):
            raise NotImplementedError(
                f"fully_shard: parameter {name!r} has placements {param.placements}; fsdp "
                "composes with Shard(d) and Replicate() tensor-parallel placements only")
    mesh = param.device_mesh
    if smallest_tp_numel(mesh, param.placements, tuple(param.shape)) == 0:
        raise NotImplementedError(
            f"fully_shard: parameter {name!r} of shape {tuple(param.shape)} placed "
            f"{param.placements} on mesh {mesh} leaves some TP rank "
            "no elements; fsdp needs every TP-local tensor non-empty (use fewer TP ranks for "
            "it, or keep it Replicate)")
    local_shape = ragged_shape(mesh, param.placements, tuple(param.shape))
    if tuple(param._local_tensor.shape) != local_shape:
        raise ValueError(f"fully_shard: parameter {name!r} has a local tensor of shape "
                         f"{tuple(param._local_tensor.shape)}, but {param.placements} of shape "
                         f"{tuple(param.shape)} give {local_shape}")
    return local_shape


def plan_layouts(named_params: Sequence[tuple[str, nn.Parameter]],
                 dp_meshes: Mapping[str, DeviceMesh],
                 spmd: SPMDMesh | None = None) -> dict[str, TPLayout]:
    """:func:`plan_layout` for every DTensor among ``named_params`` over its data-parallel
    mesh (``dp_meshes``, by name), by name; with ``spmd`` (``fully_shard(...,
    dp_mesh_dims=...)``), :func:`plan_spmd_layout` for every parameter."""
    if spmd is not None:
        return {name: plan_spmd_layout(name, param, spmd) for name, param in named_params}
    return {name: plan_layout(name, param, dp_meshes[name])
            for name, param in named_params if isinstance(param, DTensor)}


def sharded_parameter(buffer: DBuffer, name: str, layout: TPLayout,
                      requires_grad: bool) -> nn.Parameter:
    """The registered sharded parameter of a TP parameter: a DTensor on the combined mesh
    whose local tensor is the buffer's own view (optimizer steps write into the buffer)."""
    local = buffer.local_view(name)
    dp_placements = buffer.sharded_param(name).placements
    param = nn.Parameter(layout.sharded_dtensor(local, dp_placements), requires_grad=requires_grad)
    param._local_tensor = local
    return param


def _cut_carries(layout: TPLayout, names: tuple[str, ...], ours: tuple[str | None, ...],
                 placements: Sequence[Placement]) -> bool:
    """Whether ``placements`` (a value's on ``layout.param_mesh``, whose dims are ``names``)
    cut the tensor the same on the sharded mesh (fsdp's dims ``ours``, then the others in
    order): a DTensor cuts along its mesh dims in order, so each dim that cuts must be there
    (not flattened away), and two cuts whose order the sharded mesh swaps must commute."""
    others = iter(range(len(ours), len(ours) + len(names)))
    where = [(ours.index(name) if name in ours else None) if i in layout.dp_indices
             else next(others) for i, name in enumerate(names)]
    cuts = [(where[i], p) for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    if any(at is None for at, _ in cuts):
        return False
    return all(a < b or _commute(p, q) for k, (a, p) in enumerate(cuts) for b, q in cuts[k + 1:])


def _commute(p: Placement, q: Placement) -> bool:
    """Whether two placements cut alike in either order: a ``Partial`` cuts nothing, and
    shards of different tensor dims are independent."""
    if isinstance(p, Partial) or isinstance(q, Partial):
        return True
    shards = (Shard, _StridedShard)
    return isinstance(p, shards) and isinstance(q, shards) and p.dim != q.dim


@dataclass(eq=False)
class TPManagedParam(ManagedParam):
    """A :class:`~fsdp.managed_param.ManagedParam` whose parameter is tensor-parallel: the
    unsharded parameter and its gradient are DTensors in the parameter's TP spec, and the
    sharded gradient one in the combined spec, over the same DBuffer views."""

    layout: TPLayout | None = None
    # On an SPMD mesh: the data-parallel placements of this parameter's latest gradient.
    learned_grad_dp: tuple[Placement, ...] | None = None

    @property
    def _layout(self) -> TPLayout:
        assert self.layout is not None
        return self.layout

    def _logical(self, view: torch.Tensor) -> torch.Tensor:
        """The TP-local tensor over a buffer view (the view itself here)."""
        return view

    def _as_param_tensor(self, view: torch.Tensor) -> torch.Tensor:
        return self._layout.tp_dtensor(self._logical(view))

    def _as_grad_tensor(self, view: torch.Tensor) -> torch.Tensor:
        return self._layout.tp_dtensor(self._logical(view), self._grad_dp_placements())

    def _grad_dp_placements(self) -> tuple[Placement, ...]:
        """The data-parallel placements ``.grad`` is aimed with: those of the gradients
        autograd gives, so that it adds each one in place (an aimed ``Replicate`` would
        make DTensor all-reduce a ``Partial`` gradient over dp before adding it). Before the
        first gradient: ``Partial``, where each dp rank computed on its own data."""
        if self.learned_grad_dp is None:
            return (Partial(),) * len(self._layout.dp_indices)
        return self.learned_grad_dp

    def _hook_grads(self, param: nn.Parameter) -> None:
        """As :meth:`ManagedParam._hook_grads`; on an SPMD mesh each gradient's
        data-parallel placements are checked first (:meth:`_check_grad_placements`)."""
        super()._hook_grads(param)
        if self._layout.dp_indices:
            param.register_hook(self._check_grad_placements)

    def _check_grad_placements(self, grad: torch.Tensor) -> None:
        """Before autograd adds ``grad`` to ``.grad`` (on an SPMD mesh): learn its
        data-parallel placements. The parameter's first gradient since its last reduction
        re-aims a ``.grad`` aimed with others (its part of the buffer is still zero); a later
        one placed unlike the earlier ones raises (on every rank: placements are global
        facts), since the sum would mix a ``Partial`` with a ``Replicate``."""
        if not isinstance(grad, DTensor):
            return
        placements = self._layout.split(grad.placements)[0]
        if self.got_grad and self.learned_grad_dp not in (None, placements):
            raise NotImplementedError(
                f"parameter {self.name!r}: its gradient is placed {placements} on the "
                f"data-parallel dims, where its earlier gradients since the last reduction "
                f"were {self.learned_grad_dp}; fsdp accumulates gradients of one placement per "
                "parameter on an SPMD mesh")
        self.learned_grad_dp = placements
        assert self.unsharded is not None
        aimed = self.unsharded.grad
        if isinstance(aimed, DTensor) and self._layout.split(aimed.placements)[0] != placements:
            self.unsharded.grad = self._buffer_grad()

    def _local(self, grad: torch.Tensor) -> torch.Tensor:
        return self._layout.tp_local(grad)

    def adopt(self, value: torch.Tensor) -> None:
        """Take in an assigned value (``load_state_dict(..., assign=True)``, or ``module.w =
        nn.Parameter(...)`` after ``fully_shard``): a DTensor on the sharded parameter's mesh
        or on the parameter's own (:meth:`loadable`), redistributed to the sharded
        parameter's placements where it is placed otherwise (placements are global facts:
        every rank redistributes alike). A plain tensor would need the TP cut too, which is
        not supported (raises rather than copying the wrong rows)."""
        value = self.loadable(value)
        mesh = self.sharded.device_mesh
        if isinstance(value, DTensor) and value.device_mesh == mesh:
            if value.placements != self.sharded.placements:
                value = value.redistribute(mesh, self.sharded.placements)
            super().adopt(value)
            return
        raise NotImplementedError(
            f"parameter {self.name!r} is tensor-parallel: a value assigned after fully_shard "
            f"must be a DTensor on the sharded parameter's mesh ({mesh}) or on the "
            f"parameter's own ({self._layout.param_mesh}); assign before fully_shard, or copy "
            "into the parameter instead")

    def loadable(self, value: object) -> object:
        """A DTensor on the parameter's own mesh (a state dict taken before ``fully_shard``,
        or FSDP2's), as a DTensor of the same values on the sharded parameter's mesh:
        DTensor's ``copy_`` refuses two meshes, and the meshes differ where fsdp's dims are
        not the parameter's (a TP mesh; DDP mode's shard dim of one rank; flattened or
        reordered dims).

        The value is first redistributed on the parameter's mesh (once, at load) to the
        parameter's TP placements, keeping its cut over fsdp's dims where that cut means the
        same on the sharded mesh (:func:`_cut_carries`), else gathered over them (a cut over a
        dim fsdp flattens away, or two cuts of one tensor dim whose order fsdp's mesh swaps).
        Then its local tensor is rewrapped on the sharded mesh: the coordinates on the dims
        kept by name are the same (the meshes are joined from one world's). Placements are
        global facts, so every rank takes the same branch.
        """
        layout = self._layout
        names = layout.param_mesh.mesh_dim_names
        if (not isinstance(value, DTensor) or layout.param_mesh == layout.mesh
                or value.device_mesh != layout.param_mesh or names is None):
            return value  # unnamed dims cannot be matched: copy_ decides
        ours = layout.mesh.mesh_dim_names or (None,) * layout.mesh.ndim
        ours = ours[:layout.mesh.ndim - len(layout.tp_placements)]
        target = layout.on_param_mesh(layout.split(value.placements)[0])
        if not _cut_carries(layout, names, ours, target):
            target = layout.param_placements
        if tuple(value.placements) != target:
            value = value.redistribute(layout.param_mesh, target)
        dp, rest = layout.split(target)
        by_name = dict(zip(layout.split(names)[0], dp))
        placements = tuple(by_name.get(name, Replicate()) for name in ours) + rest
        return DTensor.from_local(value._local_tensor, layout.mesh, placements, run_check=False,
                                  shape=value.shape, stride=value.stride())

    def sharded_on(self, buffer: DBuffer) -> nn.Parameter:
        """A new combined-mesh sharded parameter over ``buffer`` (after ``model.to(dtype)``)."""
        return sharded_parameter(buffer, self.name, self._layout, self.sharded.requires_grad)

    def sharded_grad(self) -> DTensor:
        """The reduced gradient: the sharded gradient buffer's view on the combined mesh."""
        placements = self.sharded.placements
        dp_placements = placements[:len(placements) - len(self._layout.tp_placements)]
        return self._layout.sharded_dtensor(self.buffer.sharded_grad_view(self.name),
                                            dp_placements)
