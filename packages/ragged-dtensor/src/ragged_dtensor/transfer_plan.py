"""Planning one tensor's move between two placements on one mesh dimension.

A :class:`Transfer` says what this rank sends to every rank and how it assembles its new local
tensor from what it receives; :func:`plan_transfer` builds it from the source and target
:class:`~ragged_dtensor.flat_layout.FlatLayout` with no communication, so the pieces of many
tensors can share one collective (:func:`ragged_dtensor.redistribute.run_transfers`). Only the
elements that change owner are sent; ``Replicate`` sources are sliced locally, ``Partial``
sources are reduced on arrival.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Placement

from ragged_dtensor.flat_layout import FlatLayout
from ragged_dtensor.identities import reduction_identity

_REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Transfer:
    """One tensor's part of a redistribution on one mesh dimension.

    ``sends[q]`` is the 1-D piece for rank ``q`` and ``recv_numels[p]`` the size expected from
    rank ``p``; ``sends is None`` means no communication. ``finish`` turns the received pieces
    (per source rank) into the new local tensor.
    """

    sends: list[torch.Tensor] | None
    recv_numels: list[int]
    finish: Callable[[list[torch.Tensor]], torch.Tensor]


def is_plain_partial(placement: Placement) -> bool:
    """A torch ``Partial`` whose reduction the transfers can apply (sum, avg, max, min)."""
    return type(placement) is Partial and placement.reduce_op in _REDUCE_OPS


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
) -> tuple[Transfer, int | None]:
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
        return Transfer(None, [], lambda _: local), bad

    if src_layout is not None and src_layout.replicated:
        if dst_layout is None:
            raise unsupported
        return Transfer(None, [], lambda _: _take(flat, dst_layout, rank)), bad

    if src_layout is None:
        if not is_plain_partial(src) or dst_layout is None:
            raise unsupported
        op, mine = src.reduce_op, dst_layout.local_shape(rank)
        sends = [flat] * world_size if dst_layout.replicated else _pieces_by_owner(flat, 0, dst_layout)
        return Transfer(
            sends,
            [dst_layout.local_numel(rank)] * world_size,
            lambda pieces: _reduce(pieces, op).view(mine),
        ), bad

    if dst_layout is None:
        if not is_plain_partial(dst):
            raise unsupported
        scale = world_size if dst.reduce_op == "avg" else 1

        def to_partial(_: list[torch.Tensor]) -> torch.Tensor:
            out = torch.full((whole.numel,), reduction_identity(dst.reduce_op, dtype), dtype=dtype, device=device)
            _scatter_views(flat * scale if scale != 1 else flat, src_layout.owner_views(out, 0)[rank])
            return out.view(shape)

        return Transfer(None, [], to_partial), bad

    if dst_layout.replicated:
        def gathered(pieces: list[torch.Tensor]) -> torch.Tensor:
            if src_layout.contiguous:
                return torch.cat(pieces).view(shape)
            out = torch.empty(whole.numel, dtype=dtype, device=device)
            for piece, views in zip(pieces, src_layout.owner_views(out, 0), strict=True):
                _scatter_views(piece, views)
            return out.view(shape)

        recv = [src_layout.local_numel(p) for p in range(world_size)]
        return Transfer([flat] * world_size, recv, gathered), bad

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
        return Transfer(sends, recv, lambda pieces: torch.cat(pieces).view(mine)), bad

    out = torch.empty(dst_layout.local_numel(rank), dtype=dtype, device=device)
    views = src_layout.owner_views(out, dst_layout.bounds[rank])
    recv = [sum(v.numel() for v in vs) for vs in views]

    def assemble(pieces: list[torch.Tensor]) -> torch.Tensor:
        for piece, vs in zip(pieces, views, strict=True):
            _scatter_views(piece, vs)
        return out.view(mine)

    return Transfer(sends, recv, assemble), bad


def size_error(index: int, rank: int, numel: int, shape: tuple[int, ...], src: Placement,
               world_size: int) -> str:
    """The message for tensor ``index`` whose local tensor on ``rank`` has ``numel`` elements."""
    expected = (
        FlatLayout(shape, world_size, replicated=True).numel
        if src.is_partial()
        else FlatLayout.of(src, shape, world_size).local_numel(rank)
    )
    return (
        f"tensor {index}: the local tensor on rank {rank} has {numel} elements, but {src!r} of a "
        f"tensor of shape {shape} gives that rank {expected}"
    )
