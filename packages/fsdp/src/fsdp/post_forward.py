"""What a group keeps after forward: ``reshard_after_forward`` as FSDP2 defines it.

``True`` frees the unsharded parameters, ``False`` keeps them, and an int ``k`` (a factor of
the shard dimension's size, e.g. the ranks of one node) keeps each rank's ``1/k`` of the
unsharded buffer, so the backward's all-gather runs over ``k`` neighbouring ranks only
(:meth:`dbuffer.DBuffer.reshard_to_group`): memory between forward and backward traded for
traffic that stays inside the node.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp.per_world import once_per_world


def resolve(reshard_after_forward: bool | int | None, mesh: DeviceMesh) -> bool | int | None:
    """Check an int against the shard dimension and reduce ``1`` and the full size to the
    bools they mean (FSDP2's rules and error).

    Args:
        reshard_after_forward: the ``fully_shard`` argument.
        mesh: the group's 1-D (FSDP) or 2-D (HSDP) mesh; the last dim shards.

    Returns:
        ``None``, a bool, or an int ``k`` with ``1 < k < shard size``.

    Raises:
        ValueError: for anything but ``None``, a bool or a factor of the shard size.
    """
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    if not isinstance(reshard_after_forward, int):
        raise ValueError("reshard_after_forward should be a bool or an int representing the "
                         f"group size to reshard to, not {reshard_after_forward!r}")
    size = mesh.size(mesh.ndim - 1)
    k = reshard_after_forward
    if k < 1 or k > size or size % k:
        raise ValueError("If passing reshard_after_forward as an int, it should be a factor "
                         f"of {size}, not {k}")
    if k == 1:
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world "
                      "size 1, instead of reshard_after_forward=True (bool)", stacklevel=3)
        return False
    return True if k == size else k


def post_forward_groups(meshes: list[DeviceMesh], k: int) -> list[dist.ProcessGroup | None]:
    """For each buffer's mesh, the group of ``k`` ranks its forward reshards to, or ``None``
    where ``k`` is its whole shard dimension (a buffer of a parameter on a mesh of its own,
    FSDP2's per-parameter meshes, may shard over fewer ranks): that buffer reshards fully."""
    return [None if m.size(m.ndim - 1) == k else post_forward_group(m, k) for m in meshes]


def post_forward_group(mesh: DeviceMesh, k: int) -> dist.ProcessGroup:
    """The group of ``k`` consecutive ranks of this rank's shard dimension that a forward
    reshards to (FSDP2's ``mesh.view(-1, k)``), created once per rank set.

    Only its members take part in creating it (``use_local_synchronization``): the shard
    dimension may be a sub-mesh (HSDP, or the data-parallel dimension beside tensor
    parallelism) whose other rows never call here.
    """
    rank = dist.get_rank()
    row = next(r for r in mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist() if rank in r)
    start = row.index(rank) // k * k
    ranks = tuple(row[start:start + k])
    return once_per_world(("post_forward", ranks), lambda: dist.new_group(
        list(ranks), use_local_synchronization=True))
