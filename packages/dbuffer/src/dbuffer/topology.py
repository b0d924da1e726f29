"""Which ranks a DBuffer shards over and which it replicates over.

A buffer is sharded over one process group. It may be given as that group, as a 1-D device
mesh, or as a 2-D ``(replicate, shard)`` device mesh for HSDP, where gradients are
reduce-scattered along the shard dimension and then all-reduced along the replicate one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Topology:
    """The process groups of one buffer.

    Attributes:
        shard_group: the group the plan shards over (its size is the plan's world size).
        replicate_group: the HSDP replicate group, or ``None`` without replication.
        mesh: the device mesh given by the caller, if any.
    """

    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None = None
    mesh: DeviceMesh | None = field(default=None, compare=False)

    @classmethod
    def resolve(cls, group: dist.ProcessGroup | DeviceMesh | None) -> Topology:
        """Interpret ``group`` as given to :class:`~dbuffer.DBuffer`.

        Args:
            group: ``None`` (the default group), a process group, a 1-D device mesh, or a 2-D
                ``(replicate, shard)`` device mesh.

        Returns:
            The buffer's topology.

        Raises:
            RuntimeError: when no default process group is initialised.
            ValueError: for a device mesh of more than two dimensions.
        """
        if not dist.is_initialized():
            raise RuntimeError("DBuffer needs an initialised torch.distributed process group "
                               "(gloo works for world size 1)")
        if group is None:
            return cls(dist.group.WORLD)
        if isinstance(group, DeviceMesh):
            if group.ndim == 1:
                return cls(group.get_group(0), None, group)
            if group.ndim == 2:
                return cls(group.get_group(1), group.get_group(0), group)
            raise ValueError(f"group: a DBuffer mesh has 1 or 2 dimensions, got {group.ndim}")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be None, a ProcessGroup or a DeviceMesh, got "
                            f"{type(group).__name__}")
        return cls(group)

    @property
    def shard_rank(self) -> int:
        """This rank's index in the shard group."""
        return dist.get_rank(self.shard_group)

    @property
    def shard_size(self) -> int:
        """The number of ranks the plan shards over."""
        return dist.get_world_size(self.shard_group)

    @property
    def replicate_size(self) -> int:
        """The number of replicas (1 without HSDP)."""
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @property
    def groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Every group of the topology, shard group first."""
        if self.replicate_group is None:
            return (self.shard_group,)
        return (self.shard_group, self.replicate_group)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh DTensors of this buffer live on (built from the shard group if none given).

        Args:
            device_type: ``"cpu"`` or ``"cuda"``.

        Returns:
            The caller's mesh, or a 1-D mesh over the shard group.
        """
        if self.mesh is not None:
            return self.mesh
        return _mesh_from_group(self.shard_group, device_type)


_MESHES: dict[tuple[int, str], DeviceMesh] = {}


def _mesh_from_group(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    key = (id(group), device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]
