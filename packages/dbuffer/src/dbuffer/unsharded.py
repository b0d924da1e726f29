"""DBuffer's unsharded parameters: the all-gather that fills them in place, the in-place
free, and the piece kept for a smaller group's all-gather (FSDP2's
``reshard_after_forward=k``).

A mixin of :class:`dbuffer.DBuffer`, so that this lifecycle reads in one file: the methods
are DBuffer's and documented with it. The state set up in :meth:`UnshardedParams._init_unsharded`
is this file's; the layout, the sharded buffer and the collectives' configuration are
DBuffer's (``buffer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from ragged_dtensor import collective_guard

from dbuffer import kernels
from dbuffer.collectives import CollectiveHandle, all_gather_into
from dbuffer.flat import FlatBuffer
from dbuffer.scopes import scope


@dataclass(frozen=True)
class _Piece:
    """This rank's piece of the unsharded buffer kept for a smaller group's all-gather, and
    the sharded buffer's version it was cut at (a later version makes it stale)."""

    tensor: torch.Tensor
    group: dist.ProcessGroup
    sharded_version: int


class UnshardedParams:
    """The unsharded parameter buffer's lifecycle (mixed into :class:`dbuffer.DBuffer`)."""

    _unsharded: FlatBuffer
    _piece: _Piece | None

    def _init_unsharded(self) -> None:
        self._unsharded = FlatBuffer(self.world_size * self.shard_size, self.compute_dtype,
                                     self.device, "unsharded parameter buffer",
                                     allocated=False, hint="call all_gather() first")
        self._piece = None

    @property
    def is_unsharded(self) -> bool:
        """Whether the unsharded parameter buffer holds memory (after :meth:`all_gather`)."""
        return self._unsharded.allocated

    @property
    def unsharded_buffer(self) -> torch.Tensor:
        """The flat unsharded parameter buffer (``W*S`` elements of ``compute_dtype``).

        Raises:
            FreedBufferError: when it is freed.
        """
        self._unsharded.check("unsharded_buffer", "call all_gather() first")
        return self._unsharded.tensor

    def all_gather(self, async_op: bool = False) -> CollectiveHandle | None:
        """Fill the unsharded parameter buffer with one all-gather, in place.

        Without a dtype change the collective's input is the sharded buffer itself. With
        ``compute_dtype != dtype``, one fused launch casts the whole shard into this rank's
        slice of the unsharded buffer, which is then the input.

        Args:
            async_op: return a handle instead of waiting.

        Returns:
            With ``async_op``, a handle whose ``wait()`` completes the gather; else ``None``.
        """
        self._check_on_device("all_gather")
        S = self.shard_size
        piece = self._current_piece()
        self._piece = None
        group = self.topology.shard_group if piece is None else piece.group
        comm = self._all_gather_comm
        self._unsharded.allocate(self._new(self._allocator(comm, group), self.world_size * S,
                                           self.compute_dtype, self._unsharded.what))
        out = self._unsharded.tensor
        # Restored when the issue returns and again at the handle's wait (see FlatBuffer.writing).
        keep_version = torch.autograd._unsafe_preserve_version_counter(out)
        with scope("dbuffer::all_gather"), torch.no_grad(), keep_version:
            if piece is not None:
                shard = piece.tensor
            elif self.compute_dtype == self.dtype:
                shard = self._sharded.tensor
            else:
                shard = out.narrow(0, self.rank * S, S)
                kernels.copy_cast_(shard, self._sharded.tensor)
            work = all_gather_into(out, shard, group, async_op, comm)
        if not async_op:
            return None
        guard = collective_guard("all_gather", group)
        return CollectiveHandle(work, guard, keep_version=keep_version)

    def unsharded_view(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in full, shaped like it: a view of the unsharded buffer.

        The same view object is returned every time; it stays valid across
        :meth:`free_unsharded` and the next :meth:`all_gather`; any use of it between raises
        :class:`~dbuffer.FreedBufferError`.

        Args:
            name: the tensor.

        Returns:
            A view of the unsharded buffer at the plan's offset.

        Raises:
            FreedBufferError: when the unsharded buffer is freed.
        """
        entry = self._entry(name)
        self._unsharded.check(f"unsharded_view({name!r})", "call all_gather() first")
        return self._view("unsharded", name, self._unsharded, entry.offset, entry.numel,
                          self._shape(name))

    def free_unsharded(self) -> None:
        """Release the unsharded parameter memory (storage resized to 0 in place); until the
        next :meth:`all_gather`, using a view handed out earlier raises
        :class:`~dbuffer.FreedBufferError`. A piece kept by :meth:`reshard_to_group` is
        dropped too."""
        self._piece = None
        self._unsharded.free()

    # --------------------------------------------------- resharding to a smaller group
    def reshard_to_group(self, group: dist.ProcessGroup) -> None:
        """Free the unsharded buffer but keep this rank's piece of it for ``group``: FSDP2's
        ``reshard_after_forward=k``. ``group`` is ``k`` ranks of the shard group (e.g. one
        node); this rank keeps piece ``dist.get_rank(group)`` of the ``k`` equal pieces (one
        copy of ``W*S/k`` elements), and the next :meth:`all_gather` rebuilds the buffer with
        a ``k``-rank all-gather of the pieces instead of the ``W``-rank one of the shards,
        trading memory held between forward and backward for traffic that stays in the
        group. When the sharded buffer changed since (an optimizer step), the pieces are
        stale and :meth:`all_gather` gathers the shards instead.

        Args:
            group: the smaller group; its size divides the unsharded buffer's length.

        Raises:
            FreedBufferError: when the unsharded buffer is freed (nothing to keep).
            ValueError: when the group's size does not divide the buffer (the same on
                every rank of a buffer, so every rank raises).
        """
        self._unsharded.check("reshard_to_group", "call all_gather() first")
        k, numel = dist.get_world_size(group), self._unsharded.tensor.numel()
        if numel % k:
            raise ValueError(f"DBuffer.reshard_to_group: a group of {k} ranks cannot hold "
                             f"equal pieces of the {numel}-element unsharded buffer")
        n = numel // k
        start = dist.get_rank(group) * n
        piece = self._unsharded.tensor.narrow(0, start, n).clone()
        self._unsharded.free()
        self._piece = _Piece(piece, group, self._sharded.tensor._version)

    def _current_piece(self) -> _Piece | None:
        piece = self._piece
        if piece is None or piece.sharded_version != self._sharded.tensor._version:
            return None
        return piece

    @property
    def piece_numel(self) -> int:
        """Elements this rank holds for a smaller-group gather (:meth:`reshard_to_group`),
        0 when it holds none."""
        return 0 if self._piece is None else self._piece.tensor.numel()
