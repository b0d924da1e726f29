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
float8, integer and bool buffers travel as bytes (``.view(torch.uint8)``): gloo has no float8
or bool type, and an all-gather moves bytes without arithmetic.

On gloo groups the two collectives run as in-place broadcasts and reduces
(:mod:`dbuffer.gloo_collectives`): gloo's own versions stage the whole tensor through a
temporary and are slower.

A caller may replace either collective with its own (:class:`AllGatherComm`,
:class:`ReduceScatterComm`: FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
interface): the object then allocates the buffers that collective touches
(:func:`allocate`) and runs it on them. Or it may keep the collectives and take their
buffers from the process group's allocator (:class:`GroupMemory`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Protocol

import torch
import torch.distributed as dist
from ragged_dtensor import collective_guard

from dbuffer import gloo_collectives
from dbuffer.errors import BYTE_DTYPES
from dbuffer.scopes import scope


class CollectiveHandle:
    """A pending collective plus the work to run once it completes.

    ``wait()`` is idempotent; the handle keeps every buffer the collective uses alive.
    """

    def __init__(self, work: dist.Work | gloo_collectives.Works | None, guard: collective_guard,
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
            with scope("comm:wait"), self._guard, keep:
                self._work.wait()
        if self._then is not None:
            self._then()
        self._done = True
        self._work = self._then = self._keep_version = self._guard = None

    def is_completed(self) -> bool:
        """Whether :meth:`wait` has run to the end."""
        return self._done


class AllGatherComm(Protocol):
    """A custom all-gather (FSDP2's ``AllGather``): where its buffers come from, and the
    collective itself (``output_tensor`` receives every rank's ``input_tensor`` in rank
    order)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor: ...

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None: ...


class ReduceScatterComm(Protocol):
    """A custom reduce-scatter (FSDP2's ``ReduceScatter``): where its buffers come from, and
    the collective itself (``output_tensor`` receives this rank's slice of the ``op``
    reduction of ``input_tensor``)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor: ...

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp,
                 async_op: bool = False) -> dist.Work | None: ...


class GroupMemory:
    """Buffers from a process group's own allocator (FSDP2's
    ``set_allocate_memory_from_process_group_for_comm``): the backend's ``allocate_tensor``
    where it has one (NCCL's registered memory, which lets it transfer without copies, e.g.
    over SHARP), ``torch.empty`` where it has none (gloo), as FSDP2 falls back. It has the
    custom comms' ``allocate`` interface, so :func:`allocate` checks what it returns. A
    meta-device buffer (no memory) takes the device's allocator: no backend serves it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        numel = math.prod(size)
        if device.type != "meta":
            backend = self.group._get_backend(device)
            if backend.supports_tensor_alloc(device):
                return backend.allocate_tensor(numel, dtype=dtype, device=device)
        return torch.empty(numel, dtype=dtype, device=device)


def check_comm(comm: object, setter: str) -> None:
    """Raise ``TypeError`` naming ``setter`` unless ``comm`` is ``None`` or has the custom
    collective interface (a callable with a callable ``allocate``)."""
    if comm is not None and not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(f"{setter}: comm must be None or a callable with an "
                        "allocate(size, *, dtype, device) method (FSDP2's AllGather / "
                        f"ReduceScatter interface), got {type(comm).__name__}")


def allocate(comm: AllGatherComm | ReduceScatterComm | GroupMemory | None, numel: int,
             dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    """A new 1-D buffer of ``numel`` elements for a collective: ``torch.empty``, or the
    custom comm's (or :class:`GroupMemory`'s) ``allocate``, checked to own exactly that
    memory (DBuffer frees and restores buffers in place, which needs a storage of its own).

    Raises:
        TypeError: when the comm returns anything else, naming the comm and the buffer.
    """
    if comm is None:
        return torch.empty(numel, dtype=dtype, device=device)
    tensor = comm.allocate((numel,), dtype=dtype, device=device)
    nbytes = numel * dtype.itemsize
    if not (isinstance(tensor, torch.Tensor) and tensor.dtype == dtype
            and tensor.device.type == device.type
            and device.index in (None, tensor.device.index)
            and tensor.numel() == numel and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == nbytes):
        got = (f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device} (storage of "
               f"{tensor.untyped_storage().nbytes()} bytes at offset {tensor.storage_offset()})"
               if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
        raise TypeError(f"{type(comm).__name__}.allocate(({numel},), dtype={dtype}, "
                        f"device={device}) for the {what} returned {got}; it must return a new "
                        f"contiguous tensor of exactly {numel} elements ({nbytes} bytes) that "
                        "owns its memory")
    return tensor.view(numel)


def _is_single(group: dist.ProcessGroup) -> bool:
    return group.size() == 1


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend moves it: float8, integer and bool as their bytes."""
    return tensor.view(torch.uint8) if tensor.dtype in BYTE_DTYPES else tensor


def _local_copy(output: torch.Tensor, source: torch.Tensor) -> None:
    """A one-rank collective: ``output = source`` unless they are the same memory."""
    if output.data_ptr() != source.data_ptr() or output.numel() != source.numel():
        output.copy_(source)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                    async_op: bool, comm: AllGatherComm | None = None
                    ) -> dist.Work | gloo_collectives.Works | None:
    """Gather every rank's ``shard`` into ``output`` (rank r's at ``[r*S, (r+1)*S)``).

    ``shard`` may be the slice of ``output`` this rank owns (an in-place all-gather). On a
    one-rank group: a local copy (none for an in-place gather), no collective, ``None``.
    A custom ``comm`` runs instead, on every group size (as FSDP2 calls it).
    """
    if comm is None and _is_single(group):
        _local_copy(output, shard)
        return None
    with scope("comm:all_gather"), collective_guard("all_gather", group):
        if comm is not None:
            return comm(output_tensor=_wire(output), input_tensor=_wire(shard), group=group,
                        async_op=async_op)
        gather = (gloo_collectives.all_gather_single if gloo_collectives.serves(group, output)
                  else dist.all_gather_single)
        return gather(_wire(output), _wire(shard), group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                        async_op: bool, comm: ReduceScatterComm | None = None, *,
                        consume: bool = False) -> dist.Work | gloo_collectives.Works | None:
    """Sum ``full`` over the ranks and leave this rank's ``S``-element slice in ``output``,
    with a custom ``comm`` if given.

    ``consume=True`` lets the collective use ``full`` as scratch (its values are undefined
    afterwards), which the in-place gloo path needs; without it gloo's own reduce-scatter
    runs.

    On a one-rank group: a local copy (none when ``output`` is ``full``), ``None``, custom
    comm or not (FSDP2 calls none there either)."""
    if _is_single(group):
        _local_copy(output, full)
        return None
    with scope("comm:reduce_scatter"), collective_guard("reduce_scatter", group):
        if comm is not None:
            return comm(output_tensor=output, input_tensor=full, group=group,
                        op=dist.ReduceOp.SUM, async_op=async_op)
        scatter = (gloo_collectives.reduce_scatter_single
                   if consume and gloo_collectives.serves(group, full)
                   else dist.reduce_scatter_single)
        return scatter(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``tensor`` in place over ``group`` (the HSDP replicate dimension); the identity on
    a one-rank group."""
    if _is_single(group):
        return
    with scope("comm:all_reduce"), collective_guard("all_reduce", group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
