"""Fully sharded data parallel training built on RaggedShard, the planner and DBuffer.

A drop-in for torch 2.13's FSDP2: change ``from torch.distributed.fsdp import fully_shard``
to ``from fsdp import fully_shard``. Parameters become RaggedShard DTensors whose local
tensors are views of a flat DBuffer laid out by the structure-aware planner, so every rank
holds whole units (rows by default, or what ``unit_policy`` asks) and the all-gather and
reduce-scatter run in place, with no copy-in and no copy-out.

:class:`PeerFailureError`, :func:`record_failure` and :func:`set_roll_call_timeout` are
ragged-dtensor's, re-exported: a collective that fails because another rank raised, died or
hung raises a ``PeerFailureError`` naming that rank.
"""

from fsdp.fp8 import BlockwiseFP8
from fsdp.fully_shard import (FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method,
                              share_comm_ctx)
from fsdp.memory_first import optimizer_in_backward
from fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, UnitPolicy, row_unit
from fsdp.spmd_mesh import DataParallelMeshDims
from ragged_dtensor import PeerFailureError, record_failure, set_roll_call_timeout

from fsdp import checkpoint

__all__ = [
    "BlockwiseFP8",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "PeerFailureError",
    "UnitPolicy",
    "UnshardHandle",
    "fully_shard",
    "optimizer_in_backward",
    "record_failure",
    "register_fsdp_forward_method",
    "row_unit",
    "set_roll_call_timeout",
    "share_comm_ctx",
]
__version__ = "0.15.1"
