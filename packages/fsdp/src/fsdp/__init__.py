"""Fully sharded data parallel training built on RaggedShard, the planner and DBuffer.

A drop-in for torch 2.13's FSDP2: change ``from torch.distributed.fsdp import fully_shard``
to ``from fsdp import fully_shard``. Parameters become RaggedShard DTensors whose local
tensors are views of a flat DBuffer laid out by the structure-aware planner, so every rank
holds whole units (rows by default, or what ``unit_policy`` asks) and the all-gather and
reduce-scatter run in place, with no copy-in and no copy-out.
"""

from fsdp.fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, UnitPolicy, row_unit
from fsdp import checkpoint

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnitPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "row_unit",
]
__version__ = "0.1.0"
