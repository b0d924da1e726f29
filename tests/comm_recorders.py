"""Custom collectives that record what they do (FSDP2's ``AllGather`` / ``ReduceScatter``
interface): every block their ``allocate`` handed out (address, bytes) and every call, so a
test can check that a system ran its collectives through them and on their memory. They run
the collective DBuffer runs by default on the group (on gloo its in-place versions), so
results can be compared bit for bit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from dbuffer import gloo_collectives
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _Blocks:
    """The blocks a comm allocated: ``(address, nbytes)``, in order."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, int]] = []

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        block = torch.empty(*size, dtype=dtype, device=device)
        self.blocks.append((block.data_ptr(), block.nbytes))
        return block

    def last_holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies inside the last block allocated."""
        start, nbytes = self.blocks[-1]
        return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + nbytes


class RecordingAllGather(_Blocks, AllGather):
    """DBuffer's default all-gather, counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        self.calls += 1
        gather = (gloo_collectives.all_gather_single
                  if gloo_collectives.serves(group, output_tensor) else dist.all_gather_single)
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingReduceScatter(_Blocks, ReduceScatter):
    """DBuffer's default reduce-scatter of an input it may consume, with the ops it was
    called with."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dist.ReduceOp] = []

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp,
                 async_op: bool = False) -> dist.Work | None:
        self.ops.append(op)
        scatter = (gloo_collectives.reduce_scatter_single
                   if gloo_collectives.serves(group, input_tensor)
                   else dist.reduce_scatter_single)
        return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
