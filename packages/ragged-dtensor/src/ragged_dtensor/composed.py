"""RaggedShard beside ``Shard`` placements on other mesh dims: FSDP composed with tensor parallelism.

fsdp shards what tensor parallelism (TP) leaves on each rank: ``parallelize_module`` cuts a
weight with ``Shard(d)`` over the TP mesh dim, then ``fully_shard`` cuts each rank's TP-local
tensor into ragged runs over the data-parallel mesh dim. The sharded parameter is a DTensor on
the combined mesh with placements ``(RaggedShard, *tp_placements)``.

**Order.** In such a spec ``RaggedShard`` always applies *last*: it cuts the local tensor that
the ``Shard`` placements of the other mesh dims leave (the TP-local tensor), whatever its mesh
dim's position. Where the dims ``RaggedShard`` flattens and the ``Shard`` dims are disjoint
(``RowwiseParallel``'s ``Shard(1)`` under row units) this is DTensor's own outer-first order,
since the two cuts commute. Where TP shards a dim ``RaggedShard`` flattens
(``ColwiseParallel``'s ``Shard(0)`` under row units) DTensor's order would cut the global rows
first; the order recorded by this convention is the one FSDP2 records with
``_StridedShard(0, split_factor=tp)``, and every path of this package that reads a ragged run
(redistribution, propagation, reductions, ``from_local``'s check) reads it on the TP-local
shape :func:`ragged_shape` gives.

**Uneven TP cuts.** A ``Shard(d)`` whose dim does not divide by its mesh dim's size cuts as
torch cuts it (``torch.chunk``: the first coordinates get ``ceil(n / size)``, later ones fewer,
possibly none), so the TP-local shape and origin depend on the rank's TP coordinate
(:func:`tp_box`). Each rank's ``RaggedShard`` then describes the runs of *its* data-parallel
group (the ranks sharing its TP coordinate, which hold TP-local tensors of one shape): placements
of ranks at different TP coordinates may differ, and every path here reads only its own
(ragged runs move inside a data-parallel group; the TP dims move with torch's own uneven
``Shard`` handling). A path that needs another coordinate's run (a full state dict scattered
from rank 0) asks that rank (:func:`is_uneven` says when, from global facts).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from ragged_dtensor.placement import RaggedShard, ragged_mesh_dims


def is_tp_shard(placement: Placement) -> bool:
    """A plain ``Shard(d)`` on a mesh dim beside a RaggedShard (one the composition supports)."""
    return type(placement) is Shard


def is_composed(placements: Sequence[Placement]) -> bool:
    """Whether ``placements`` hold a RaggedShard and a ``Shard`` on another mesh dim."""
    return bool(ragged_mesh_dims(placements)) and any(is_tp_shard(p) for p in placements)


def refuse(placements: Sequence[Placement], what: str) -> None:
    """Raise ``NotImplementedError`` naming ``what`` for composed ``placements`` (a path that
    reads ragged runs on the global shape and would misplace them).

    Args:
        placements: a DTensor's placements.
        what: the operation, for the message.
    """
    if is_composed(placements):
        raise NotImplementedError(
            f"{what} on a RaggedShard DTensor beside tensor-parallel Shard placements "
            f"({tuple(placements)}) are not supported")


def tp_box(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int],
           coordinate: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where the TP-local tensor of the rank at mesh ``coordinate`` lies in the global tensor:
    the ``Shard`` cuts of the mesh dims other than the RaggedShard's, nested outer mesh dims
    first and each cut ``torch.chunk``-style, as DTensor cuts them (so uneven cuts give
    coordinates different boxes, and a late coordinate may get an empty one).

    Args:
        mesh: the DTensor's mesh.
        placements: its placements, one per mesh dim.
        shape: its global shape.
        coordinate: a rank's index along every mesh dim; ``None``: this rank's.

    Returns:
        ``(origin, local_shape)``: the box's global offsets and its shape (``shape`` itself and
        zeros when there are no ``Shard`` placements).

    Raises:
        NotImplementedError: for a ``_StridedShard`` beside the RaggedShard.
        ValueError: when ``coordinate`` is ``None``, a ``Shard`` placement is present and this
            rank is not in ``mesh``.
    """
    if coordinate is None and any(is_tp_shard(p) for p in placements):
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"the TP-local shape of a DTensor on {mesh} on a rank outside it "
                             "needs the coordinate it is asked for")
    origin, local = [0] * len(shape), list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            raise NotImplementedError(
                f"{p!r} beside a RaggedShard (placements {tuple(placements)}) is not supported")
        if is_tp_shard(p):
            size, offset = Shard.local_shard_size_and_offset(
                local[p.dim], mesh.size(mesh_dim), coordinate[mesh_dim])
            local[p.dim] = size
            origin[p.dim] += offset
    return tuple(origin), tuple(local)


def ragged_shape(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int],
                 coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
    """The shape a RaggedShard in ``placements`` cuts on the rank at ``coordinate``: ``shape``
    after the (possibly uneven) ``Shard`` cuts of the other mesh dims, ``shape`` itself when
    there are none (see :func:`tp_box`).

    Args:
        mesh: the DTensor's mesh.
        placements: its placements, one per mesh dim.
        shape: its global shape.
        coordinate: a rank's index along every mesh dim; ``None``: this rank's.

    Returns:
        The TP-local shape.

    Raises:
        NotImplementedError: for a ``_StridedShard`` beside the RaggedShard.
    """
    return tp_box(mesh, placements, shape, coordinate)[1]


def is_uneven(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> bool:
    """Whether the ``Shard`` cuts beside a RaggedShard give ranks TP-local tensors of
    different shapes (then their RaggedShards may differ too). A global fact: every rank
    answers alike.

    Args:
        mesh: the DTensor's mesh.
        placements: its placements, one per mesh dim.
        shape: its global shape.
    """
    local = list(shape)
    for mesh_dim, p in enumerate(placements):
        if is_tp_shard(p):
            if local[p.dim] % mesh.size(mesh_dim):
                return True
            local[p.dim] //= mesh.size(mesh_dim)
    return False


def smallest_tp_numel(mesh: DeviceMesh, placements: Sequence[Placement],
                      shape: Sequence[int]) -> int:
    """The fewest elements any rank's TP-local tensor holds (0 when an uneven cut leaves a
    coordinate nothing). A global fact: every rank answers alike.

    Args:
        mesh: the DTensor's mesh.
        placements: its placements, one per mesh dim.
        shape: its global shape.
    """
    axes = [range(mesh.size(d)) if is_tp_shard(p) else range(1) for d, p in enumerate(placements)]
    return min(math.prod(ragged_shape(mesh, placements, shape, coordinate))
               for coordinate in itertools.product(*axes))


def spec_ragged_shape(spec: DTensorSpec) -> tuple[int, ...]:
    """:func:`ragged_shape` of a spec on this rank."""
    return ragged_shape(spec.mesh, spec.placements, tuple(spec.shape))


def _with(spec: DTensorSpec, placements: Sequence[Placement]) -> DTensorSpec:
    meta = spec.tensor_meta
    return DTensorSpec(spec.mesh, tuple(placements),
                       tensor_meta=TensorMeta(meta.shape, meta.stride, meta.dtype))


def _unragged(spec: DTensorSpec) -> DTensorSpec:
    return _with(spec, [Replicate() if isinstance(p, RaggedShard) else p for p in spec.placements])


def redistribute(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """Redistribute where ``src`` or ``dst`` is composed (see :func:`is_composed`).

    The ragged mesh dim moves on the TP-local shape; the other mesh dims are torch's. With the
    same non-ragged placements on both sides only the ragged dim moves (one ragged transfer on
    its process group); otherwise the ragged runs are gathered to the TP-local tensor first,
    torch redistributes the rest, and the target's ragged run is sliced out locally.

    Args:
        local: this rank's local tensor under ``src``.
        src: the current spec.
        dst: the target spec (same mesh).

    Returns:
        The local tensor under ``dst``.

    Raises:
        NotImplementedError: for RaggedShard on two different mesh dims, or an unsupported
            placement beside it.
    """
    from ragged_dtensor import redistribute as ragged_redistribute

    src_dims, dst_dims = ragged_mesh_dims(src.placements), ragged_mesh_dims(dst.placements)
    dims = set(src_dims) | set(dst_dims)
    if len(dims) != 1:
        raise NotImplementedError(
            f"ragged redistribute from {tuple(src.placements)} to {tuple(dst.placements)}: "
            "RaggedShard may sit on only one mesh dimension")
    (dim,) = dims
    mesh = src.mesh
    others = [i for i in range(mesh.ndim) if i != dim]
    if src_dims and dst_dims and all(src.placements[i] == dst.placements[i] for i in others):
        return ragged_redistribute._move_ragged_dim(
            local, spec_ragged_shape(src), src.placements[dim], dst.placements[dim], mesh, dim)
    if src_dims:
        local = ragged_redistribute._move_ragged_dim(
            local, spec_ragged_shape(src), src.placements[dim], Replicate(), mesh, dim)
        src = _unragged(src)
    mid = _unragged(dst) if dst_dims else dst
    local = ragged_redistribute.redistribute_ragged_local_tensor(local, src, mid)
    if not dst_dims:
        return local
    return ragged_redistribute._move_ragged_dim(
        local.contiguous(), spec_ragged_shape(dst), Replicate(), dst.placements[dim], mesh, dim)
