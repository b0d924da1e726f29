"""``fully_shard(module, mesh=world, dp_mesh_dims=DataParallelMeshDims(...))``: torch 2.13's
full SPMD mesh.

There the model is already laid out on the whole world mesh (``distribute_module``, or
DTensors made on it): every parameter is a DTensor on ``world``, ``Replicate()`` on the
data-parallel dims, and ``dp_mesh_dims`` names which dims those are. fsdp reads that as
its tensor-parallel composition (:mod:`fsdp.tensor_parallel`) with the other dims as the
TP dims: it shards each parameter's TP-local tensor in whole units over the ``shard`` dim
(HSDP: replicated over the ``replicate`` dim), runs its collectives over those dims only,
and gives the module its unsharded parameter as the DTensor on ``world`` it was. Where the
data-parallel dims lead ``world`` (replicate, then shard), the sharded parameter is a DTensor
on ``world`` itself, placements ``(RaggedShard, *rest)`` (HSDP: ``(Replicate(), RaggedShard,
*rest)``); elsewhere see below. fsdp's error agreement runs along the data-parallel dims and
the dims some parameter is cut over (TP), not along a dim every parameter is
``Replicate()`` on (a pipeline dim, whose ranks make other stages' calls). Those dims are
read from the parameters' placements, the same on every rank of a valid layout; a
rank-local error in a group whose parameters are all ``Replicate()`` on a TP dim reaches its
data-parallel peers only. A gradient keeps what it has on the
data-parallel dims (``Partial`` or ``Replicate``): the reduce-scatter is its reduction,
with no all-reduce before it, as in FSDP2. One accumulation (the gradients of a parameter
between two reductions) holds one of the two: mixing them raises ``NotImplementedError``.

Several shard names (``shard=("dp_shard", "cp")``, torchtitan's ``dp_shard_cp``) are
flattened into one dim, and several replicate names too, as FSDP2 flattens them for its
collectives: fsdp shards over the flattened shard dim and replicates over the flattened
replicate dim, and the sharded parameter lives on the flattened dims followed by the
others (HSDP: ``(Replicate(), RaggedShard, *rest)``). That is FSDP2's mesh for several shard
names; for several replicate names beside one shard name (or none) FSDP2 keeps the
replicate dims apart on the SPMD mesh (``(Replicate(), Replicate(), Shard(0), *rest)``),
fsdp's HSDP has one replicate dim: the values are the same, the sharded parameter's mesh
differs.

Replicate-only (DDP, ``DataParallelMeshDims(replicate=...)``) is HSDP with a shard dim of
one rank, unflattened from the replicate dim: every rank holds whole parameters and the
gradients are all-reduced over the replicas, as in FSDP2. The sharded parameters then have
one dim more than FSDP2's (placements ``(Replicate(), RaggedShard, *rest)`` on
``(replicate, <replicate>_shard, *rest)``, the ragged shard over one rank holding all of
it).

The data-parallel dims may be anywhere on the mesh (``("pp", "dp", "tp")``, ``("tp",
"dp")``, ``("dp_shard", "dp_replicate")``). Where they are not its leading dims in the order
(replicate, shard), the sharded parameters live on the data-parallel dims followed by the
others in the mesh's order (``("dp", "pp", "tp")``), a mesh joined from the same world's
ranks: the ragged cut then applies to the TP-local tensor, as on every other mesh fsdp
builds. FSDP2 keeps its ``Shard(0)`` on the SPMD mesh's own dim; the values are the same.

Several names in one role go in the mesh's order (torch's mesh slicing raises ``KeyError``
otherwise, for FSDP2 too). What fsdp does not take (``NotImplementedError``, on every rank):
an int ``reshard_after_forward`` (FSDP2 refuses that one too).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import DataParallelMeshDims

from fsdp.per_world import once_per_world

__all__ = ["DataParallelMeshDims", "SPMDMesh", "resolve"]


@dataclass(frozen=True)
class SPMDMesh:
    """A full SPMD mesh and which of its dims are fsdp's.

    Attributes:
        mesh: the mesh ``fully_shard`` was given (every parameter is a DTensor on it).
        dp_indices: the indices of its data-parallel dims (replicate and shard), ascending.
        sharded_mesh: the sharded parameters' mesh: ``mesh`` itself, or where dims were
            flattened into one, the data-parallel dims do not lead in the order (replicate,
            shard), or DDP mode adds its shard dim of one rank, the data-parallel mesh's dims
            followed by the others.
    """

    mesh: DeviceMesh
    dp_indices: tuple[int, ...]
    sharded_mesh: DeviceMesh


def resolve(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims,
            reshard_after_forward: bool | int | None) -> tuple[DeviceMesh, SPMDMesh]:
    """fsdp's data-parallel mesh (1-D, or 2-D ``(replicate, shard)``) inside ``mesh``.

    Args:
        mesh: the full SPMD mesh.
        dp_mesh_dims: which of its dims are data-parallel.
        reshard_after_forward: ``fully_shard``'s argument (an int is refused here).

    Returns:
        The data-parallel mesh and the :class:`SPMDMesh` the parameters are planned on.

    Raises:
        TypeError: for a ``dp_mesh_dims`` that is not a ``DataParallelMeshDims``.
        ValueError: for a mesh without dim names, or a name it lacks (FSDP2's words), or a
            name given twice.
        NotImplementedError: for what the module docstring lists.
    """
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got "
                        f"{type(dp_mesh_dims).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    shard, replicate = dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    dp_names = (*replicate, *shard)
    twice = sorted({name for name in dp_names if dp_names.count(name) > 1})
    if twice:
        raise ValueError(f"fully_shard: dp_mesh_dims={dp_mesh_dims} names mesh dims {twice} "
                         "more than once")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError("reshard_after_forward as int is not yet supported with SPMD "
                                  "mesh (dp_mesh_dims)")
    indices = tuple(i for i, name in enumerate(names) if name in dp_names)
    rest = tuple(name for name in names if name not in dp_names)
    if not shard:
        # DDP: HSDP over the replicate dim with a shard dim of one rank, so that every rank
        # holds whole parameters and the gradients are all-reduced over the replicas
        dp_mesh = _with_shard_of_one(_one_dim(mesh, replicate))
        return dp_mesh, SPMDMesh(mesh, indices, _followed_by(dp_mesh, mesh, rest))
    if len(shard) == 1 and len(replicate) <= 1 and names[:len(dp_names)] == dp_names:
        return _submesh(mesh, dp_names), SPMDMesh(mesh, indices, mesh)
    dp_mesh = joined([_one_dim(mesh, role) for role in (replicate, shard) if role])
    return dp_mesh, SPMDMesh(mesh, indices, _followed_by(dp_mesh, mesh, rest))


def _followed_by(dp_mesh: DeviceMesh, mesh: DeviceMesh, rest: tuple[str, ...]) -> DeviceMesh:
    """The sharded parameters' mesh: ``dp_mesh``'s dims, then ``mesh``'s dims ``rest``."""
    return joined([dp_mesh, _submesh(mesh, rest)]) if rest else dp_mesh


def _with_shard_of_one(replicas: DeviceMesh) -> DeviceMesh:
    """``replicas`` (1-D) unflattened into ``(name, name_shard)`` of sizes ``(n, 1)``: made
    once per mesh and world (unflattening creates process groups, a collective every rank
    runs in the same order)."""
    (name,) = replicas.mesh_dim_names or ("replicate",)
    return once_per_world(("shard_of_one", replicas), lambda: replicas._unflatten(
        0, (replicas.size(), 1), (name, f"{name}_shard")))


def _submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The dims ``names`` of ``mesh``, as their own mesh."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def _one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh of ``names``: the dim itself, or the dims flattened into one (named by
    joining theirs with ``_``, as FSDP2 names it)."""
    return _submesh(mesh, names) if len(names) == 1 else mesh[names]._flatten("_".join(names))


def joined(parts: list[DeviceMesh]) -> DeviceMesh:
    """One mesh of ``parts``' dims, in order (torch's ``DeviceMesh._concatenate``: a
    ``RuntimeError`` unless the parts index one world's ranks along independent dims)."""
    return parts[0] if len(parts) == 1 else DeviceMesh._concatenate(parts)
