"""All-gather and reduce-scatter for gloo process groups, built from broadcasts and reduces
that work in place.

gloo's own ``all_gather_single`` and ``reduce_scatter_single`` stage the whole unsharded
tensor through a temporary of its size (measured with exact allocator bytes in torch 2.13:
a 64 MB gather or reduce-scatter allocates 64 MB more while it runs) and are the slower
algorithms: on this 2-core machine, 16 MB shards, ``all_gather_single`` takes 43 / 88 /
138 ms on 2 / 3 / 4 ranks where one ``broadcast`` per rank takes 21 / 34 / 56 ms, and
``reduce_scatter_single`` 53 / 114 / 199 ms where one ``reduce`` per rank takes 29 / 56 /
88 ms. Both replacements allocate nothing:

* the all-gather broadcasts each rank's input from its owner into that rank's slice of the
  output, and copies this rank's input into its own slice while the transfers run;
* the reduce-scatter reduces slice ``r`` of the input onto rank ``r`` in place, then copies
  this rank's slice into the output. gloo's reduce uses the other slices of every rank's
  input as scratch, so the input is destroyed: callers pass only a buffer they discard (the
  unsharded gradients DBuffer frees after the reduction).

Each runs one collective per rank, so it pays one collective's latency per rank: for small
slices gloo's own single collective is faster (4 ranks, 1 MB slices: 14 ms per reduce-scatter
against gloo's 12 ms; 2 MB slices: 18 ms against 23 ms). :func:`serves` therefore picks them
only for slices of at least :data:`MIN_SLICE_BYTES`, where the temporary gloo's own would
allocate is the size that matters as well.

The two functions have ``torch.distributed``'s signatures, so :mod:`dbuffer.collectives`
swaps them in for gloo groups and a test's recorder can watch them as the collectives they
stand for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

MIN_SLICE_BYTES = 2 << 20
"""Smallest per-rank slice (bytes) for which :func:`serves` picks these collectives."""


def serves(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether these collectives should run on ``tensor`` (the unsharded side: the gather's
    output, the reduction's input): a CPU tensor on a group whose backend for CPU is gloo,
    with slices of at least :data:`MIN_SLICE_BYTES` per rank."""
    return (tensor.device.type == "cpu" and _gloo_on_cpu(group)
            and tensor.nbytes // group.size() >= MIN_SLICE_BYTES)


@functools.cache
def _gloo_on_cpu(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs CPU collectives on gloo; asked before every collective and
    fixed for the group's life, so asked of torch once (its answer costs several
    microseconds of Python)."""
    backend = dist.get_backend(group)
    return backend == "gloo" or "cpu:gloo" in backend


class Works:
    """Several pending collectives completed as one, then a local step (FSDP2's ``Work``
    interface: ``wait()``, ``is_completed()``)."""

    def __init__(self, works: list[dist.Work], then: Callable[[], None] | None = None) -> None:
        self._works = works
        self._then = then
        self._done = False

    def wait(self) -> bool:
        """Block until every collective completed, then run the local step (once)."""
        if not self._done:
            for work in self._works:
                work.wait()
            if self._then is not None:
                self._then()
            self._done = True
            self._works, self._then = [], None
        return True

    def is_completed(self) -> bool:
        """Whether :meth:`wait` has run to the end."""
        return self._done


def _slices(tensor: torch.Tensor, group: dist.ProcessGroup) -> tuple[list[torch.Tensor], int]:
    world = dist.get_world_size(group)
    size = tensor.numel() // world
    return [tensor.narrow(0, r * size, size) for r in range(world)], size


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                      group: dist.ProcessGroup, async_op: bool = False) -> Works | None:
    """``output_tensor`` receives every rank's ``input_tensor`` in rank order (equal sizes);
    ``input_tensor`` may be this rank's slice of the output."""
    slices, size = _slices(output_tensor, group)
    if size == 0:
        return None
    rank = dist.get_rank(group)
    works = [dist.broadcast(input_tensor if r == rank else piece, group=group, group_src=r,
                            async_op=True)
             for r, piece in enumerate(slices)]
    # The collective's local part, while the transfers run (an all-gather's own kernel
    # copies it too).
    if slices[rank].data_ptr() != input_tensor.data_ptr():
        slices[rank].copy_(input_tensor)
    return _finish(Works(works), async_op)


def reduce_scatter_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          op: dist.ReduceOp, group: dist.ProcessGroup,
                          async_op: bool = False) -> Works | None:
    """``output_tensor`` receives this rank's slice of the ``op`` reduction of
    ``input_tensor`` over the group. ``input_tensor`` is used as scratch: every slice but
    this rank's is left undefined, this rank's holds the result."""
    slices, size = _slices(input_tensor, group)
    if size == 0:
        return None
    own = slices[dist.get_rank(group)]
    works = [dist.reduce(piece, group=group, group_dst=r, op=op, async_op=True)
             for r, piece in enumerate(slices)]

    def copy_out() -> None:
        if own.data_ptr() != output_tensor.data_ptr():
            output_tensor.copy_(own)

    return _finish(Works(works, copy_out), async_op)


def _finish(works: Works, async_op: bool) -> Works | None:
    if async_op:
        return works
    works.wait()
    return None
