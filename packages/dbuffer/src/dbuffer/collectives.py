"""The in-place collectives of a DBuffer, as plain functions over flat buffers.

Nothing here allocates or copies: the caller passes the exact buffers (the all-gather input
is a buffer or a slice of the output, the reduce-scatter output is the sharded gradient
buffer or the one temporary the dtypes require). Each call and each wait runs in a
profiler scope named ``comm:<op>``, so copies the backend makes while it runs (gloo stages
data through temporaries) are told apart from copies DBuffer issues, and under a
:class:`ragged_dtensor.collective_guard`, so a peer's failure raises a
:class:`ragged_dtensor.PeerFailureError` naming the rank at fault. Asynchronous calls
return a :class:`CollectiveHandle` whose ``wait()`` completes the collective and then runs the
buffer's follow-up step (HSDP all-reduce, averaging, cast into the sharded gradients).

On a group of one rank no collective is issued (FSDP2 issues none either): the all-gather's
output already is the shard or receives it by one local copy, the reduce-scatter's output is
the whole input (one copy unless it is the same memory), and the all-reduce is the identity.
float8 buffers travel as bytes (``.view(torch.uint8)``): gloo has no float8 type, and an
all-gather moves bytes without arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from ragged_dtensor import collective_guard
from torch.profiler import record_function

from dbuffer.errors import BYTE_DTYPES


class CollectiveHandle:
    """A pending collective plus the work to run once it completes.

    ``wait()`` is idempotent; the handle keeps every buffer the collective uses alive.
    """

    def __init__(self, work: dist.Work | None, guard: collective_guard,
                 then: Callable[[], None] | None = None, *,
                 keep_version: torch.autograd._unsafe_preserve_version_counter | None = None
                 ) -> None:
        self._work = work
        self._guard = guard
        self._then = then
        self._keep_version = keep_version
        self._done = False

    def wait(self) -> None:
        """Block until the collective and its follow-up step have finished."""
        if self._done:
            return
        if self._work is not None:
            # gloo writes an async all-gather's output (on its worker thread, or here in
            # wait()), bumping the autograd version of a buffer whose views autograd saved;
            # refilling them with the same values must not invalidate the saved tensors, so
            # the version taken before the collective was issued is restored.
            keep = self._keep_version if self._keep_version is not None else nullcontext()
            with record_function("comm:wait"), self._guard, keep:
                self._work.wait()
        if self._then is not None:
            self._then()
        self._done = True
        self._work = self._then = self._keep_version = self._guard = None

    def is_completed(self) -> bool:
        """Whether :meth:`wait` has run to the end."""
        return self._done


def _is_single(group: dist.ProcessGroup) -> bool:
    return dist.get_world_size(group) == 1


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend moves it: float8 as its bytes."""
    return tensor.view(torch.uint8) if tensor.dtype in BYTE_DTYPES else tensor


def _local_copy(output: torch.Tensor, source: torch.Tensor) -> None:
    """A one-rank collective: ``output = source`` unless they are the same memory."""
    if output.data_ptr() != source.data_ptr() or output.numel() != source.numel():
        output.copy_(source)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                    async_op: bool) -> dist.Work | None:
    """Gather every rank's ``shard`` into ``output`` (rank r's at ``[r*S, (r+1)*S)``).

    ``shard`` may be the slice of ``output`` this rank owns (an in-place all-gather). On a
    one-rank group: a local copy (none for an in-place gather), no collective, ``None``.
    """
    if _is_single(group):
        _local_copy(output, shard)
        return None
    with record_function("comm:all_gather"), collective_guard("all_gather", group):
        return dist.all_gather_single(_wire(output), _wire(shard), group=group,
                                      async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                        async_op: bool) -> dist.Work | None:
    """Sum ``full`` over the ranks and leave this rank's ``S``-element slice in ``output``.

    On a one-rank group: a local copy (none when ``output`` is ``full``), ``None``."""
    if _is_single(group):
        _local_copy(output, full)
        return None
    with record_function("comm:reduce_scatter"), collective_guard("reduce_scatter", group):
        return dist.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group,
                                          async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``tensor`` in place over ``group`` (the HSDP replicate dimension); the identity on
    a one-rank group."""
    if _is_single(group):
        return
    with record_function("comm:all_reduce"), collective_guard("all_reduce", group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
