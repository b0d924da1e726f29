"""Every redistribution to, from and between ``RaggedShard`` placements, and its DTensor hook.

torch routes ``DTensor.redistribute`` / ``full_tensor`` (and their backward), the input
redistributions planned by sharding propagation, and ``from_local``'s backward through one
function, ``redistribute_local_tensor``, imported by name into three modules. :func:`install`
replaces it in all three with a wrapper that hands transitions involving ``RaggedShard`` to
the paths below and everything else to torch.

On one mesh dimension, a transition is planned as a :class:`_Transfer`: what this rank sends
to every rank and how it assembles what it receives. Communicating transfers run as ONE
``all_to_all_single`` (see :mod:`ragged_dtensor.exchange`), however many tensors move:

==========================  ============================================================
source -> target            collective
==========================  ============================================================
Replicate -> RaggedShard    none (local slice)
RaggedShard -> Partial      none (identity-filled full tensor with the local run placed)
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor import _dispatch as dtensor_dispatch
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ragged_dtensor.exchange import exchange
from ragged_dtensor.flat_layout import FlatLayout
from ragged_dtensor.placement import RaggedShard

_REDUCE_OPS = ("sum", "avg", "max", "min")
_PATCH_SITES = (dtensor_redistribute, dtensor_dispatch, dtensor_api)
# torch's function; if this module is re-imported after install(), the installed wrapper
# remembers it, so the wrapper never wraps itself
_ORIGINAL = getattr(
    dtensor_redistribute.redistribute_local_tensor,
    "torch_original",
    dtensor_redistribute.redistribute_local_tensor,
)


@dataclass(frozen=True)
class _Transfer:
    """One tensor's part of a redistribution on one mesh dimension.

    ``sends[q]`` is the 1-D piece for rank ``q`` and ``recv_numels[p]`` the size expected from
    rank ``p``; ``sends is None`` means no communication. ``finish`` turns the received pieces
    (per source rank) into the new local tensor.
    """

    sends: list[torch.Tensor] | None
    recv_numels: list[int]
    finish: Callable[[list[torch.Tensor]], torch.Tensor]


def _is_plain_partial(placement: Placement) -> bool:
    return type(placement) is Partial and placement.reduce_op in _REDUCE_OPS


def _identity(reduce_op: str, dtype: torch.dtype) -> float | int | bool:
    """The value that leaves a reduction unchanged (filling the elements a rank does not hold)."""
    if reduce_op in ("sum", "avg"):
        return 0
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    if reduce_op == "max":
        return -float("inf") if dtype.is_floating_point else info.min
    return float("inf") if dtype.is_floating_point else info.max


def _reduce(pieces: list[torch.Tensor], reduce_op: str) -> torch.Tensor:
    """Reduce the pieces received from every rank, accumulating in place (no stacked copy)."""
    out = pieces[0].clone()
    combine = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[reduce_op]
    for piece in pieces[1:]:
        combine(out, piece, out=out)
    if reduce_op == "avg":
        return out.div_(len(pieces)) if out.is_floating_point() else out.floor_divide_(len(pieces))
    return out


def _take(flat: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    """``rank``'s local tensor of ``layout``, cut from the full flat tensor ``flat`` (a copy)."""
    if layout.contiguous:
        run = flat[layout.bounds[rank] : layout.bounds[rank + 1]]
        return run.clone().view(layout.local_shape(rank))
    block = flat.view(layout.shape).narrow(
        layout.shard_dim, layout.chunks[rank], layout.chunks[rank + 1] - layout.chunks[rank]
    )
    return block.contiguous()


def _gather_views(views: list[torch.Tensor]) -> torch.Tensor:
    """The elements of ``views`` as one 1-D tensor (a view when there is a single 1-D view)."""
    if len(views) == 1 and views[0].dim() == 1:
        return views[0]
    return torch.cat([v.reshape(-1) for v in views])


def _scatter_views(source: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copy the 1-D ``source`` into ``views`` in order."""
    offset = 0
    for view in views:
        view.copy_(source[offset : offset + view.numel()].view(view.shape))
        offset += view.numel()


def _pieces_by_owner(flat: torch.Tensor, start: int, layout: FlatLayout) -> list[torch.Tensor]:
    """``flat`` (flat elements from ``start``) split into one 1-D piece per owning rank."""
    return [
        _gather_views(views) if views else flat[:0]
        for views in layout.owner_views(flat, start)
    ]


def plan_transfer(
    local: torch.Tensor,
    shape: tuple[int, ...],
    src: Placement,
    dst: Placement,
    rank: int,
    world_size: int,
) -> tuple[_Transfer, int | None]:
    """Plan moving ``local`` from ``src`` to ``dst`` on one mesh dimension.

    Args:
        local: this rank's local tensor under ``src``.
        shape: the global shape.
        src: source placement (Replicate, Shard, RaggedShard or a sum/avg/max/min Partial).
        dst: target placement (Replicate, Shard, RaggedShard; Partial only from a shard).
        rank: this rank's coordinate on the mesh dimension.
        world_size: size of the mesh dimension.

    Returns:
        The transfer, and ``local.numel()`` when it does not match ``src`` (``None`` if it
        does); a wrong-sized local is replaced by zeros so the collective stays consistent.

    Raises:
        ValueError: if a RaggedShard does not fit the shape or the mesh dimension.
        NotImplementedError: for an unsupported pair.
    """
    device, dtype = local.device, local.dtype
    whole = FlatLayout(shape, world_size, replicated=True)
    src_layout = None if src.is_partial() else FlatLayout.of(src, shape, world_size)
    dst_layout = None if dst.is_partial() else FlatLayout.of(dst, shape, world_size)
    expected = whole.numel if src_layout is None else src_layout.local_numel(rank)
    bad = None
    flat = local.reshape(-1)
    if local.numel() != expected:
        bad, flat = local.numel(), torch.zeros(expected, dtype=dtype, device=device)
    unsupported = NotImplementedError(f"ragged redistribute from {src} to {dst} is not supported")

    if src == dst:
        return _Transfer(None, [], lambda _: local), bad

    if src_layout is not None and src_layout.replicated:
        if dst_layout is None:
            raise unsupported
        return _Transfer(None, [], lambda _: _take(flat, dst_layout, rank)), bad

    if src_layout is None:
        if not _is_plain_partial(src) or dst_layout is None:
            raise unsupported
        op, mine = src.reduce_op, dst_layout.local_shape(rank)
        sends = [flat] * world_size if dst_layout.replicated else _pieces_by_owner(flat, 0, dst_layout)
        return _Transfer(
            sends,
            [dst_layout.local_numel(rank)] * world_size,
            lambda pieces: _reduce(pieces, op).view(mine),
        ), bad

    if dst_layout is None:
        if not _is_plain_partial(dst):
            raise unsupported
        scale = world_size if dst.reduce_op == "avg" else 1

        def to_partial(_: list[torch.Tensor]) -> torch.Tensor:
            out = torch.full((whole.numel,), _identity(dst.reduce_op, dtype), dtype=dtype, device=device)
            _scatter_views(flat * scale if scale != 1 else flat, src_layout.owner_views(out, 0)[rank])
            return out.view(shape)

        return _Transfer(None, [], to_partial), bad

    if dst_layout.replicated:
        def gathered(pieces: list[torch.Tensor]) -> torch.Tensor:
            if src_layout.contiguous:
                return torch.cat(pieces).view(shape)
            out = torch.empty(whole.numel, dtype=dtype, device=device)
            for piece, views in zip(pieces, src_layout.owner_views(out, 0), strict=True):
                _scatter_views(piece, views)
            return out.view(shape)

        recv = [src_layout.local_numel(p) for p in range(world_size)]
        return _Transfer([flat] * world_size, recv, gathered), bad

    if not (src_layout.contiguous or dst_layout.contiguous):
        raise unsupported
    mine = dst_layout.local_shape(rank)
    if dst_layout.contiguous:
        cuts = [src_layout.count_before(b, rank) for b in dst_layout.bounds]
        sends = [flat[cuts[q] : cuts[q + 1]] for q in range(world_size)]
    else:
        sends = _pieces_by_owner(flat, src_layout.bounds[rank], dst_layout)
    if src_layout.contiguous:
        cuts = [dst_layout.count_before(b, rank) for b in src_layout.bounds]
        recv = [cuts[p + 1] - cuts[p] for p in range(world_size)]
        return _Transfer(sends, recv, lambda pieces: torch.cat(pieces).view(mine)), bad

    out = torch.empty(dst_layout.local_numel(rank), dtype=dtype, device=device)
    views = src_layout.owner_views(out, dst_layout.bounds[rank])
    recv = [sum(v.numel() for v in vs) for vs in views]

    def assemble(pieces: list[torch.Tensor]) -> torch.Tensor:
        for piece, vs in zip(pieces, views, strict=True):
            _scatter_views(piece, vs)
        return out.view(mine)

    return _Transfer(sends, recv, assemble), bad


def _size_error(index: int, rank: int, numel: int, shape: tuple[int, ...], src: Placement,
                world_size: int) -> str:
    expected = (
        FlatLayout(shape, world_size, replicated=True).numel
        if src.is_partial()
        else FlatLayout.of(src, shape, world_size).local_numel(rank)
    )
    return (
        f"tensor {index}: the local tensor on rank {rank} has {numel} elements, but {src!r} of a "
        f"tensor of shape {shape} gives that rank {expected}"
    )


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
        return _size_error(i, p, n, shapes[i], srcs[i], world)

    moving = [i for i, (t, _) in enumerate(planned) if t.sends is not None]
    if not moving:
        if bads:
            raise ValueError(describe(bads[0][0], rank, bads[0][1]))
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
    dims = {i for i, p in enumerate(src) if isinstance(p, RaggedShard)}
    dims |= {i for i, p in enumerate(dst) if isinstance(p, RaggedShard)}
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
    if src.is_partial() and not _is_plain_partial(src):
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
    if not any(isinstance(p, RaggedShard) for p in (*src, *dst)):
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


redistribute_ragged_local_tensor.torch_original = _ORIGINAL


def install() -> None:
    """Route torch's ``redistribute_local_tensor`` through the ragged paths (idempotent)."""
    for module in _PATCH_SITES:
        module.redistribute_local_tensor = redistribute_ragged_local_tensor
