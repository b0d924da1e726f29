"""dbuffer: a zero-copy distributed flat buffer for FSDP, with fused whole-buffer kernels.

Parameters (sharded and unsharded) and gradients of one FSDP group are views into flat
buffers laid out by a :class:`layout_planner.Plan`, so all-gather and reduce-scatter run in
place. See :class:`dbuffer.DBuffer` and :mod:`dbuffer.kernels`.
"""

from dbuffer import kernels
from dbuffer.buffer import DBuffer
from dbuffer.collectives import AllGatherComm, CollectiveHandle, ReduceScatterComm
from dbuffer.errors import SUPPORTED_DTYPES, FreedBufferError
from dbuffer.freed import is_released, metadata_access, release_in_place
from dbuffer.scopes import scope

__all__ = ["SUPPORTED_DTYPES", "AllGatherComm", "CollectiveHandle", "DBuffer", "FreedBufferError",
           "ReduceScatterComm", "is_released", "kernels", "metadata_access", "release_in_place",
           "scope"]
