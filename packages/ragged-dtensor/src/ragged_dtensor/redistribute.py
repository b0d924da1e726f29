"""Every redistribution to, from and between ``RaggedShard`` placements, and its DTensor hook.

torch routes ``DTensor.redistribute`` / ``full_tensor`` (and their backward), the input
redistributions planned by sharding propagation, and ``from_local``'s backward through one
function, ``redistribute_local_tensor``, imported by name into three modules;
:mod:`ragged_dtensor.torch_patches` replaces it in all three with
:func:`redistribute_ragged_local_tensor`, which hands transitions involving ``RaggedShard`` to
the paths below and everything else to torch.

On one mesh dimension, a transition is planned as a :class:`~ragged_dtensor.transfer_plan.Transfer`
(:mod:`ragged_dtensor.transfer_plan`): what this rank sends to every rank and how it assembles
what it receives. Communicating transfers run as ONE
``all_to_all_single`` (see :mod:`ragged_dtensor.exchange`), however many tensors move:

==========================  ============================================================
source -> target            collective
==========================  ============================================================
Replicate -> RaggedShard    none (local slice)
RaggedShard -> Partial      a 1-element flag all-reduce (the size check), no payload
RaggedShard -> Replicate    one ``all_to_all_single`` (each run to every rank, no padding)
RaggedShard <-> Shard(d)    one ``all_to_all_single``; only elements that change owner move
RaggedShard -> RaggedShard  one ``all_to_all_single``
Partial -> RaggedShard      one ``all_to_all_single`` + local reduction (a reduce-scatter)
==========================  ============================================================

On a multi-dimensional mesh, ``RaggedShard`` may sit on one mesh dimension while the others
are ``Replicate`` or ``Partial`` (the HSDP layout ``(Replicate(), RaggedShard(...))``): the
ragged dimension moves as above on its own process group, the others all-reduce or partition
element-wise, which is valid for any local shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, Replicate

from ragged_dtensor import composed
from ragged_dtensor.consensus import raise_on_any_rank
from ragged_dtensor.exchange import exchange
from ragged_dtensor.placement import ragged_mesh_dims
from ragged_dtensor.torch_patches import torch_original
from ragged_dtensor.transfer_plan import is_plain_partial, plan_transfer, size_error

_ORIGINAL = torch_original("torch.distributed.tensor._redistribute.redistribute_local_tensor")


def run_transfers(
    locals_: Sequence[torch.Tensor],
    shapes: Sequence[tuple[int, ...]],
    srcs: Sequence[Placement],
    dsts: Sequence[Placement],
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """Move every tensor from its source to its target placement on one process group.

    All communicating transfers share ONE ``all_to_all_single``; a wrong local size on any
    rank raises the same ``ValueError`` on every rank.

    Args:
        locals_: each tensor's local piece on this rank.
        shapes: each tensor's global shape.
        srcs: each tensor's source placement on this mesh dimension.
        dsts: each tensor's target placement on this mesh dimension.
        group: the mesh dimension's process group.

    Returns:
        The new local tensors, in order.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    planned = [
        plan_transfer(t, shape, s, d, rank, world)
        for t, shape, s, d in zip(locals_, shapes, srcs, dsts, strict=True)
    ]
    bads = [(i, n) for i, (_, n) in enumerate(planned) if n is not None]

    def describe(i: int, p: int, n: int) -> str:
        return size_error(i, p, n, shapes[i], srcs[i], world)

    moving = [i for i, (t, _) in enumerate(planned) if t.sends is not None]
    if not moving:
        # no payload to carry the status: a RaggedShard source (a run whose size the user
        # supplied) is checked by a consensus; a torch placement's size is torch's to keep
        error = ValueError(describe(bads[0][0], rank, bads[0][1])) if bads else None
        if any(ragged_mesh_dims([s]) for s in srcs):
            raise_on_any_rank(error, group)
        elif error is not None:
            raise error
        return [t.finish([]) for t, _ in planned]
    received = exchange(
        [planned[i][0].sends for i in moving],
        [planned[i][0].recv_numels for i in moving],
        [locals_[i].dtype for i in moving],
        group,
        device=locals_[moving[0]].device,
        bad=bads[0] if bads else None,
        describe=describe,
    )
    pieces = dict(zip(moving, received, strict=True))
    return [t.finish(pieces.get(i, [])) for i, (t, _) in enumerate(planned)]


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def _ragged_mesh_dim(src: Sequence[Placement], dst: Sequence[Placement]) -> int:
    dims = set(ragged_mesh_dims(src)) | set(ragged_mesh_dims(dst))
    if len(dims) != 1:
        raise NotImplementedError(
            f"ragged redistribute from {tuple(src)} to {tuple(dst)}: RaggedShard may sit on only "
            "one mesh dimension"
        )
    (dim,) = dims
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if i != dim and not all(p.is_replicate() or p.is_partial() for p in (s, d)):
            raise NotImplementedError(
                f"ragged redistribute from {tuple(src)} to {tuple(dst)}: the mesh dimensions "
                "without RaggedShard must be Replicate or Partial"
            )
    return dim


def _move_other_dims(local: torch.Tensor, src: Sequence[Placement], dst: Sequence[Placement],
                     mesh: DeviceMesh, skip: int) -> torch.Tensor:
    """Element-wise transitions (Partial -> Replicate, Replicate -> Partial) off the ragged dim."""
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if i == skip or s == d:
            continue
        if s.is_partial() and d.is_replicate():
            local = _wait(s._reduce_value(local, mesh, i))
        elif s.is_replicate() and d.is_partial():
            local = d._partition_value(local, mesh, i)
        else:
            raise NotImplementedError(f"ragged redistribute from {s} to {d} on mesh dim {i}")
    return local


def _move_ragged_dim(local: torch.Tensor, shape: tuple[int, ...], src: Placement, dst: Placement,
                     mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    if src == dst:
        return local
    if src.is_partial() and not is_plain_partial(src):
        local, src = _wait(src._reduce_value(local, mesh, mesh_dim)), Replicate()
    (out,) = run_transfers([local], [shape], [src], [dst], mesh.get_group(mesh_dim))
    return out


def redistribute_ragged_local_tensor(
    local_tensor: torch.Tensor,
    current_spec: DTensorSpec,
    target_spec: DTensorSpec,
    *,
    async_op: bool = False,
    use_graph_based_transform: bool | None = None,
    is_explicit: bool = False,
) -> torch.Tensor:
    """Drop-in for torch's ``redistribute_local_tensor`` that also handles ``RaggedShard``.

    Transitions without ``RaggedShard`` go to torch unchanged. ``async_op`` is accepted and
    ignored for ragged transitions (they complete before returning).
    """
    src, dst = current_spec.placements, target_spec.placements
    if not ragged_mesh_dims(src) and not ragged_mesh_dims(dst):
        return _ORIGINAL(
            local_tensor,
            current_spec,
            target_spec,
            async_op=async_op,
            use_graph_based_transform=use_graph_based_transform,
            is_explicit=is_explicit,
        )
    mesh = current_spec.mesh
    if mesh != target_spec.mesh:
        raise NotImplementedError("redistributing a RaggedShard DTensor across meshes is not supported")
    if not mesh._is_current_rank_part_of_mesh():
        return local_tensor
    if composed.is_composed(src) or composed.is_composed(dst):  # fsdp over tensor parallelism
        return composed.redistribute(local_tensor, current_spec, target_spec)
    shape = tuple(current_spec.shape)
    dim = _ragged_mesh_dim(src, dst)
    if dst[dim].is_replicate() or dst[dim].is_partial():
        local = _move_other_dims(local_tensor, src, dst, mesh, dim)
        return _move_ragged_dim(local, shape, src[dim], dst[dim], mesh, dim)
    local = _move_ragged_dim(local_tensor, shape, src[dim], dst[dim], mesh, dim)
    return _move_other_dims(local, src, dst, mesh, dim)


def redistribute_many(
    dtensors: Sequence[DTensor], placements: Sequence[Sequence[Placement]]
) -> list[DTensor]:
    """Redistribute a list of DTensors on one 1-D mesh with ONE ``all_to_all_single``.

    Sources and targets may be ``RaggedShard``, ``Shard(d)`` or ``Replicate`` (sources also a
    sum/avg/max/min ``Partial``); a ``Replicate`` target receives every piece. Tensors of
    different dtypes share the collective: their pieces are packed as bytes (16-byte
    aligned). Tensors whose transition needs no communication (same placement, or from
    ``Replicate``) ride along without payload. The result is not differentiable (it is built
    for optimizer steps); each output is a new DTensor.

    Args:
        dtensors: DTensors on the same 1-D device mesh.
        placements: one target placement sequence (of length 1) per DTensor.

    Returns:
        The redistributed DTensors, in order.

    Raises:
        ValueError: if the lists differ in length, a mesh differs or is not 1-D, or a local
            tensor's size does not match its placement (raised on every rank).
    """
    if len(dtensors) != len(placements):
        raise ValueError(
            f"redistribute_many got {len(dtensors)} dtensors but {len(placements)} placements"
        )
    if not dtensors:
        return []
    for i, t in enumerate(dtensors):
        if not isinstance(t, DTensor):
            raise TypeError(f"redistribute_many: tensor {i} must be a DTensor, got {type(t).__name__}")
    mesh = dtensors[0].device_mesh
    for i, (t, p) in enumerate(zip(dtensors, placements, strict=True)):
        if t.device_mesh != mesh or mesh.ndim != 1 or len(p) != 1:
            raise ValueError(
                f"redistribute_many: tensor {i} must be on the first tensor's 1-D mesh with one "
                f"target placement, got mesh {t.device_mesh} and placements {tuple(p)}"
            )
        if p[0].is_partial():
            raise ValueError(f"redistribute_many: tensor {i} cannot target {p[0]}")
    with torch.no_grad():
        outs = run_transfers(
            [t._local_tensor for t in dtensors],
            [tuple(t.shape) for t in dtensors],
            [t.placements[0] for t in dtensors],
            [p[0] for p in placements],
            mesh.get_group(0),
        )
    return [
        DTensor(out, DTensorSpec(mesh, (p[0],), tensor_meta=t._spec.tensor_meta), requires_grad=False)
        for out, t, p in zip(outs, dtensors, placements, strict=True)
    ]


def patched_redistribute_local_tensor(original: object) -> object:
    """The :mod:`ragged_dtensor.torch_patches` factory of the three ``redistribute_local_tensor``
    sites (each holds torch's one function, which :func:`redistribute_ragged_local_tensor`
    calls for every transition without RaggedShard)."""
    return redistribute_ragged_local_tensor
