"""DBuffer's gradients: the unsharded gradient buffer autograd accumulates into (its views,
and the folding of gradients autograd put elsewhere), the reduce-scatter into the sharded
gradients, the stash that keeps accumulated gradients in ``reduce_dtype``, and the release
of each.

A mixin of :class:`dbuffer.DBuffer`, so that this lifecycle reads in one file: the methods
are DBuffer's and documented with it. The state set up in :meth:`Gradients._init_gradients`
is this file's; the layout, the buffers' views and the collectives' configuration are
DBuffer's (``buffer.py``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Collection
from typing import Literal

import torch
from ragged_dtensor import collective_guard, from_local_run_like
from torch.distributed.tensor import DTensor

from dbuffer import kernels
from dbuffer.collectives import CollectiveHandle, all_reduce_sum, allocate, reduce_scatter_into
from dbuffer.errors import FreedBufferError, check_gradient_dtype
from dbuffer.flat import FlatBuffer
from dbuffer.freed import metadata_access
from dbuffer.scopes import scope

ReduceOp = Literal["avg", "sum"]


class Gradients:
    """The gradient buffers' lifecycle (mixed into :class:`dbuffer.DBuffer`)."""

    _grad: FlatBuffer | None
    _grad_stash: FlatBuffer | None
    _partial_reduce: torch.Tensor | None
    _sharded_grad: torch.Tensor | None
    _sharded_grad_views: dict[str, torch.Tensor]
    _sharded_grad_dtensors: dict[str, DTensor]
    _sharded_split_plan: tuple[list[int], dict[str, int]] | None
    _folded: dict[str, tuple[weakref.ref[torch.Tensor], int]]

    def _init_gradients(self) -> None:
        self._grad = None
        self._grad_stash = None
        if self.trainable:
            self._describe_grad_buffers()
        # HSDP reduce-scatter sums waiting for their all-reduce (reduce_scatter(all_reduce=False)).
        self._partial_reduce = None
        # The sharded gradients: a plain tensor DBuffer holds from a reduce-scatter until
        # free_sharded_grad(), with the views and DTensors handed out over it; after that only
        # their holders keep the memory alive (no in-place free, nothing to fence).
        self._sharded_grad = None
        self._sharded_grad_views = {}
        self._sharded_grad_dtensors = {}
        self._sharded_split_plan = None
        # The last gradient fold_grad took per tensor (object and version), so the
        # reduce-scatter does not fold a parameter's ``.grad`` a hook already folded.
        self._folded = {}

    def _describe_grad_buffers(self) -> None:
        """The unsharded gradient buffer (and the stash of a wider ``reduce_dtype``), not
        allocated: memory comes with the first gradient."""
        n = self.world_size * self.shard_size
        self._grad = FlatBuffer(n, self.compute_dtype, self.device, "unsharded gradient buffer",
                                allocated=False, hint="call grad_view() or grad_buffer first")
        if self.reduce_dtype != self.compute_dtype:
            self._grad_stash = FlatBuffer(n, self.reduce_dtype, self.device, "gradient stash",
                                          allocated=False, hint="call stash_grad() first")

    def requires_grad(self, name: str) -> bool:
        """Whether tensor ``name`` has gradients (``requires_grad`` at construction, or
        :meth:`add_trainable` since).

        Raises:
            KeyError: for a name not in the buffer.
        """
        self._entry(name)
        return name in self._trainable_set

    def add_trainable(self, names: Collection[str]) -> None:
        """Give frozen tensors gradients from now on (a parameter frozen when the buffer was
        built and unfrozen since). Local, and touches no memory: gradient regions keep the
        plan's layout whether a tensor is frozen or not, and gradient memory is allocated at
        the first gradient anyway, so this only records the names; the unsharded and sharded
        buffers, and every view handed out, stay as they are (a pending autograd graph keeps
        working). Every rank must add the same names before its next reduction, as the
        reduce-scatter reads the same regions on every rank.

        Args:
            names: tensors of the buffer.

        Raises:
            KeyError: for a name not in the buffer.
            TypeError: when the buffer's dtypes hold no gradients (float8, integer, bool).
        """
        if isinstance(names, (str, bytes)):
            raise TypeError(f"add_trainable: names must be a collection of tensor names, got "
                            f"the string {names!r}")
        added = [n for n in names if not self.requires_grad(n)]
        if not added:
            return
        for dtype, arg in ((self.dtype, "dtype"), (self.compute_dtype, "compute_dtype"),
                           (self.reduce_dtype, "reduce_dtype")):
            check_gradient_dtype(dtype, arg)
        wanted = self._trainable_set.union(added)
        self.trainable = tuple(n for n in self.names if n in wanted)
        self._trainable_set = frozenset(self.trainable)
        self._sharded_split_plan = None
        if self._grad is None:
            self._describe_grad_buffers()
        self._warn_reserved(stacklevel=3)

    def _warn_reserved(self, stacklevel: int) -> None:
        """Warn when some tensors are trainable and some frozen: the frozen ones' regions of
        the gradient buffers are reserved all the same."""
        frozen = [n for n in self.names if n not in self._trainable_set]
        if self.trainable and frozen:
            warnings.warn(
                f"DBuffer: {len(frozen)} frozen tensor(s) ({', '.join(frozen[:4])}"
                f"{', ...' if len(frozen) > 4 else ''}) keep {self.frozen_grad_bytes} bytes "
                "of gradient buffer space reserved on this rank (unsharded and sharded "
                "gradients; kept at zero), because gradient regions keep the parameters' "
                "layout; give frozen tensors a DBuffer of their own (requires_grad=()) to "
                "reserve none", UserWarning, stacklevel=stacklevel)

    def _check_trainable(self, name: str) -> None:
        if name in self._trainable_set:
            return
        self._entry(name)  # an unknown name raises KeyError first
        raise ValueError(f"tensor {name!r} is frozen (not in requires_grad): it has no gradient")

    def _require_grad_buffer(self) -> FlatBuffer:
        if self._grad is None:
            raise ValueError("every tensor of this DBuffer is frozen: it has no gradients")
        return self._grad

    def _require_sharded_grad(self, what: str) -> torch.Tensor:
        self._require_grad_buffer()
        if self._sharded_grad is None:
            raise FreedBufferError(f"{what}: the sharded gradient buffer holds no gradient; "
                                   "call reduce_scatter() first")
        return self._sharded_grad

    @property
    def frozen_grad_bytes(self) -> int:
        """Bytes of this rank's gradient buffers (the ``W*S`` unsharded one in
        ``compute_dtype`` and the ``S`` sharded one in ``dtype``) spanned by frozen tensors:
        reserved, kept at zero, never handed out. 0 when every tensor is trainable or none
        is (then no gradient memory exists at all).

        The gradient buffers share the parameters' layout so that each sharded gradient has
        its parameter's RaggedShard ranges and the reduce-scatter stays one equal-split
        collective; dropping a frozen region would shift every later tensor's ranges.
        """
        if not self.trainable:
            return 0
        frozen = [e for e in self.plan.entries if e.name not in self.trainable]
        unsharded = sum(e.numel for e in frozen)
        local = sum(self._local_slice(e.name)[1] for e in frozen)
        return unsharded * self.compute_dtype.itemsize + local * self.dtype.itemsize

    @property
    def has_grad(self) -> bool:
        """Whether the unsharded gradient buffer holds memory."""
        return self._grad is not None and self._grad.allocated

    @property
    def has_sharded_grad(self) -> bool:
        """Whether DBuffer holds sharded gradients (a :meth:`reduce_scatter` since the last
        :meth:`free_sharded_grad`): the next reduce-scatter then adds into them."""
        return self._sharded_grad is not None

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The flat unsharded gradient buffer (``W*S`` elements of ``compute_dtype``),
        zero-filled and allocated on first use.

        Raises:
            ValueError: when every tensor is frozen.
        """
        return self._allocated_grad().tensor

    def _allocated_grad(self) -> FlatBuffer:
        """The unsharded gradient buffer, allocated zero-filled (one launch) if freed."""
        grad = self._require_grad_buffer()
        if grad.allocate(self._new(self._reduce_scatter_allocator(), grad.numel,
                                   self.compute_dtype, grad.what)):
            kernels.zero_(grad.tensor)
        return grad

    def grad_view(self, name: str) -> torch.Tensor:
        """Tensor ``name``'s unsharded gradient: a view of the gradient buffer, shaped like
        the tensor, for autograd to accumulate into (set it as the unsharded parameter's
        ``.grad``). Allocates and zero-fills the buffer (one launch) if it is freed.

        Args:
            name: a trainable tensor.

        Returns:
            A view in ``compute_dtype``.

        Raises:
            ValueError: when ``name`` is frozen.
        """
        view = self._views.get(("grad", name))
        if view is not None and self._grad is not None and self._grad.allocated:
            return view  # every backward aims each parameter's .grad here: the short path
        self._check_trainable(name)
        grad = self._allocated_grad()
        entry = self._entry(name)
        return self._view("grad", name, grad, entry.offset, entry.numel, self._shape(name))

    def grad_is_view(self, name: str, tensor: torch.Tensor | None) -> bool:
        """Whether ``tensor`` is tensor ``name``'s gradient view (or an alias of exactly its
        memory): a gradient already in the buffer, which :meth:`fold_grad` must not add
        again. Touches no data (works while the buffer is freed) and allocates nothing.

        Args:
            name: a tensor of the buffer.
            tensor: a candidate gradient, e.g. a parameter's ``.grad``; ``None`` gives False.

        Returns:
            True when ``tensor`` is the view or spans exactly its memory.
        """
        view = self._views.get(("grad", name))
        if tensor is view and view is not None:
            return True  # the per-step check of every aimed .grad: no more than this
        self._entry(name)
        if tensor is None or view is None or tensor.layout != torch.strided:
            return False  # a sparse gradient (nn.Embedding(sparse=True)) has no storage
        return (tensor.untyped_storage()._cdata == view.untyped_storage()._cdata
                and tensor.storage_offset() == view.storage_offset()
                and tensor.shape == view.shape and tensor.stride() == view.stride()
                and tensor.dtype == view.dtype)

    def fold_grad(self, name: str, grad: torch.Tensor, *, includes_view: bool = False) -> None:
        """Bring a gradient that autograd put outside the buffer into :meth:`grad_view`.

        Autograd accumulates in place into a preset ``.grad`` only in first-order backward
        passes. Under ``backward(create_graph=True)`` it *replaces* ``.grad`` by
        ``.grad + new``; a ``.grad`` that was ``None`` receives a new tensor; a user may assign
        ``.grad``. The buffer would then keep stale values and the reduce-scatter would reduce
        them, so such a gradient must be folded in: added (the default: ``grad`` holds only new
        contributions, e.g. it arrived while ``.grad`` was ``None``), or copied with
        ``includes_view=True`` (``grad`` replaced a ``.grad`` that was the view, so it already
        holds the view's value). Either way in ``compute_dtype`` (cast on the way), in place,
        allocating the buffer zero-filled if it is freed. A ``grad`` that
        :meth:`grad_is_view` is a no-op (it is already in the buffer).

        Args:
            name: a trainable tensor.
            grad: its gradient, shaped like the tensor (a plain tensor, not a DTensor).
            includes_view: ``grad`` already contains the view's value: overwrite, not add.

        Raises:
            ValueError: when ``name`` is frozen or ``grad`` has another shape.
            TypeError: when ``grad`` is a DTensor.
        """
        self._check_trainable(name)
        if self.grad_is_view(name, grad):
            return
        if isinstance(grad, DTensor) or not isinstance(grad, torch.Tensor):
            raise TypeError(f"fold_grad({name!r}): expected the unsharded gradient as a plain "
                            f"tensor, got a {type(grad).__name__}")
        if tuple(grad.shape) != self._shape(name):
            raise ValueError(f"fold_grad({name!r}): gradient of shape {tuple(grad.shape)} for "
                             f"a tensor of shape {self._shape(name)}")
        view = self.grad_view(name)
        with torch.no_grad():
            if includes_view:
                view.copy_(grad)
            else:
                view.add_(grad.to(view.dtype))
        self._folded[name] = (weakref.ref(grad), grad._version)

    def _fold_replaced_grads(self) -> None:
        """Fold the ``.grad`` of each unsharded view DBuffer handed out (used as the parameter
        itself) that is a tensor other than its gradient view and was not folded yet: the
        parameter's ``.grad`` is its gradient (a replacement by autograd under
        ``create_graph=True`` or an assignment), so it overwrites the view, and ``.grad``
        points at the view again. Local: every rank folds its own, no collective."""
        replaced = []
        with metadata_access():
            for name in self.trainable:
                param = self._views.get(("unsharded", name))
                grad = None if param is None else param.grad
                if grad is None or self.grad_is_view(name, grad):
                    continue
                ref, version = self._folded.get(name, (None, -1))
                if ref is None or ref() is not grad or grad._version != version:
                    replaced.append((name, param, grad))
        for name, param, grad in replaced:
            self.fold_grad(name, grad, includes_view=True)
            param.grad = self.grad_view(name)

    def reduce_scatter(self, op: ReduceOp = "avg", async_op: bool = False, *,
                       predivide: bool = False, free_grad: bool = False,
                       reduce_hook: Callable[[torch.Tensor], None] | None = None,
                       all_reduce: bool = True) -> CollectiveHandle | None:
        """Reduce the unsharded gradients over all ranks into the sharded gradients.

        One reduce-scatter over the shard group (then, for HSDP, one all-reduce over the
        replicate group). When the sharded gradients are freed they are overwritten,
        otherwise the reduced gradient is added to them (accumulation across reduce-scatters).
        Dtype changes and the average's division are fused into single launches: a cast of
        the gradient buffer into the reduce dtype (with the division when ``predivide``) and,
        after the collective, one scale, cast or add into the sharded gradients. When the
        dtypes allow, the collective reads the gradient buffer and writes the sharded
        gradient buffer directly; ``predivide`` without a dtype change then scales the
        gradient buffer in place (the unsharded gradients keep the divided values).

        First, the ``.grad`` of every unsharded view handed out that is not its gradient view
        (``create_graph=True`` replaced it, or it was assigned) is folded into the buffer
        (see :meth:`fold_grad`), so no gradient that exists is left out of the reduction.

        Args:
            op: ``"avg"`` (divide by the number of data-parallel ranks) or ``"sum"``.
            async_op: return a handle instead of waiting.
            predivide: divide before the collective (guards low-precision overflow) instead
                of after it.
            free_grad: release the unsharded gradient memory (:meth:`free_grad`) as soon as
                the collective no longer reads it: right after its cast into a wider
                ``reduce_dtype``, else when the collective completes. Saves one gradient
                buffer per reduction in flight; the unsharded gradients are gone afterwards.
            reduce_hook: called with this rank's reduced ``S`` elements (``reduce_dtype``)
                once the reduce-scatter (and the HSDP all-reduce) completed, before the
                division, cast and accumulation into the sharded gradients; it may change
                them in place (FSDP2's all-reduce hook: e.g. an all-reduce over replicas the
                caller manages itself).
            all_reduce: HSDP only: ``False`` stops after the reduce-scatter and keeps its sum
                in a partial buffer (``reduce_dtype``) instead of the sharded gradients; the
                next reduction with ``True`` adds it before its all-reduce over the replicas.
                Gradient accumulation over micro-batches then crosses the replicate dimension
                (e.g. nodes) once per step, as FSDP2's ``set_requires_all_reduce(False)``.

        Returns:
            With ``async_op``, a handle whose ``wait()`` completes everything; else ``None``.

        Raises:
            ValueError: for an unknown ``op`` or when every tensor is frozen.

        A rank that never wrote a gradient since the last :meth:`free_grad` (no
        :meth:`grad_view`, e.g. its experts received no tokens) contributes zeros, as in
        FSDP; every rank must still call this collectively.
        """
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        self._check_on_device("reduce_scatter")
        with scope("dbuffer::reduce_scatter"):
            return self._reduce_scatter(op, async_op, predivide, free_grad, reduce_hook,
                                        all_reduce)

    def _reduce_scatter(self, op: ReduceOp, async_op: bool, predivide: bool, free_grad: bool,
                        reduce_hook: Callable[[torch.Tensor], None] | None, all_reduce: bool
                        ) -> CollectiveHandle | None:
        # A rank that wrote no gradient (e.g. its experts got no tokens) contributes zeros:
        # raising here would leave the other ranks waiting in the collective.
        self._fold_replaced_grads()
        grad = self._allocated_grad()
        comm = self._reduce_scatter_comm
        memory = self._reduce_scatter_allocator()
        ranks = self.world_size * self.topology.replicate_size
        factor = 1.0 / ranks if op == "avg" else 1.0
        pre, post = (factor, 1.0) if predivide else (1.0, factor)

        stash = self._grad_stash
        if stash is not None and stash.allocated:
            kernels.add_(stash.tensor, grad.tensor)
            full = stash.tensor
            if pre != 1.0:
                kernels.scale_(full, pre)
        elif self.reduce_dtype == self.compute_dtype:
            full = grad.tensor
            if pre != 1.0:  # scaled in place: the unsharded gradients are consumed anyway
                kernels.scale_(full, pre)
        else:
            full = allocate(memory, grad.tensor.numel(), self.reduce_dtype, self.device,
                            "reduce-dtype copy of the unsharded gradients")
            kernels.copy_cast_(full, grad.tensor, pre)
        if free_grad and full is not grad.tensor:
            self._release_grad()  # the collective reads the reduce-dtype copy or the stash
        partial_only = not all_reduce and self.topology.replicate_group is not None
        accumulate = self._sharded_grad is not None
        direct = not accumulate and self.reduce_dtype == self.dtype and not partial_only
        if not accumulate and not partial_only:
            self._sharded_grad = (allocate(memory, self.shard_size, self.dtype, self.device,
                                           "sharded gradients") if direct else
                                  torch.empty(self.shard_size, dtype=self.dtype,
                                              device=self.device))
        sharded_grad = self._sharded_grad
        if direct:
            out = sharded_grad
        else:
            out = allocate(memory, self.shard_size, self.reduce_dtype, self.device,
                           "reduce-scatter output")
        # The collective may use the input as scratch unless it is the gradient buffer the
        # caller keeps.
        consume = free_grad or full is not grad.tensor
        group = self._reduce_scatter_group
        work = reduce_scatter_into(out, full, group, async_op, comm, consume=consume)

        def finish() -> None:
            with scope("dbuffer::reduce_scatter_finish"):
                if partial_only:
                    if self._partial_reduce is None:
                        self._partial_reduce = out
                    else:
                        kernels.add_(self._partial_reduce, out)
                    if stash is not None:
                        stash.free()
                    if free_grad:
                        self.free_grad()
                    return
                if self.topology.replicate_group is not None:
                    if self._partial_reduce is not None:
                        kernels.add_(out, self._partial_reduce)
                        self._partial_reduce = None
                    all_reduce_sum(out, self.topology.replicate_group)
                if reduce_hook is not None:
                    reduce_hook(out)
                if direct:
                    if post != 1.0:
                        kernels.scale_(out, post)
                elif accumulate:
                    kernels.add_(sharded_grad, out, post)
                else:
                    kernels.copy_cast_(sharded_grad, out, post)
                if stash is not None:
                    stash.free()
                if free_grad:
                    self.free_grad()

        if async_op:
            guard = collective_guard("reduce_scatter", group)
            return CollectiveHandle(work, guard, finish)
        finish()
        return None

    def sharded_grad_view(self, name: str) -> torch.Tensor:
        """This rank's piece of tensor ``name``'s reduced gradient (1-D, ``dtype``): a view
        of the sharded gradient buffer, laid out like :meth:`local_view`.

        The view keeps the memory alive after :meth:`free_sharded_grad` (it is owned by
        reference), so it stays valid as long as it is held.

        Args:
            name: a trainable tensor.

        Returns:
            A 1-D view; the same object until :meth:`free_sharded_grad`.

        Raises:
            ValueError: when ``name`` is frozen.
            FreedBufferError: before the first :meth:`reduce_scatter` or after
                :meth:`free_sharded_grad`.
        """
        view = self._sharded_grad_views.get(name)
        if view is not None:
            return view
        self._check_trainable(name)
        if self._sharded_grad is None:
            self._require_sharded_grad(f"sharded_grad_view({name!r})")
        # Every trainable tensor's view at once: one split costs a quarter of a narrow per
        # view, and a reduction's gradients are asked for tensor by tensor right after it.
        sizes, index = self._sharded_split()
        pieces = self._sharded_grad.split_with_sizes(sizes)
        for n, i in index.items():  # views handed out already stay the same objects
            self._sharded_grad_views.setdefault(n, pieces[i])
        return self._sharded_grad_views[name]

    def _sharded_split(self) -> tuple[list[int], dict[str, int]]:
        """The sizes that split a sharded buffer into this rank's runs of the trainable
        tensors and the gaps between them, and each tensor's piece index (cached)."""
        if self._sharded_split_plan is None:
            sizes: list[int] = []
            index: dict[str, int] = {}
            position = 0
            for (offset, numel), name in sorted((self._local_slice(n), n) for n in self.trainable):
                if offset > position:
                    sizes.append(offset - position)
                index[name] = len(sizes)
                sizes.append(numel)
                position = offset + numel
            if position < self.shard_size:
                sizes.append(self.shard_size - position)
            self._sharded_split_plan = (sizes, index)
        return self._sharded_split_plan

    def sharded_grad(self, name: str) -> DTensor:
        """Tensor ``name``'s reduced gradient as a RaggedShard DTensor over
        :meth:`sharded_grad_view` (placed like :meth:`sharded_param`, so it can be a
        parameter's ``.grad``).

        Args:
            name: a trainable tensor.

        Returns:
            The DTensor; the same object until :meth:`free_sharded_grad`.
        """
        if name not in self._sharded_grad_dtensors:
            # Built once per reduction per tensor: sharing the parameter's spec keeps that
            # to one DTensor construction (no placement or spec rebuilt each step).
            self._sharded_grad_dtensors[name] = from_local_run_like(
                self.sharded_grad_view(name), self.sharded_param(name))
        return self._sharded_grad_dtensors[name]

    @property
    def sharded_grad_buffer(self) -> torch.Tensor:
        """The flat sharded gradient buffer (``S`` elements of ``dtype``).

        Raises:
            FreedBufferError: when it holds no gradient.
        """
        return self._require_sharded_grad("sharded_grad_buffer")

    def stash_grad(self) -> None:
        """Move the unsharded gradients into a stash kept in ``reduce_dtype`` and free the
        gradient buffer: gradient accumulation without a reduction keeps its sums at the
        reduction's precision (FSDP2 does the same), not at ``compute_dtype``'s. One fused
        cast-add per call; the next :meth:`reduce_scatter` reduces stash plus gradients.
        Without a wider ``reduce_dtype`` the gradient buffer itself accumulates and this is
        a no-op.

        Raises:
            ValueError: when every tensor is frozen.
        """
        grad = self._require_grad_buffer()
        if self._grad_stash is None or not grad.allocated:
            return
        self._fold_replaced_grads()
        stash = self._grad_stash
        if stash.allocate(self._new(self._reduce_scatter_allocator(), stash.numel,
                                    self.reduce_dtype, stash.what)):
            kernels.zero_(stash.tensor)
        kernels.add_(self._grad_stash.tensor, grad.tensor)
        self._release_grad()

    @property
    def has_grad_stash(self) -> bool:
        """Whether :meth:`stash_grad` holds gradients not reduced yet."""
        return self._grad_stash is not None and self._grad_stash.allocated

    @property
    def has_partial_reduce(self) -> bool:
        """Whether reduce-scatter sums wait for their HSDP all-reduce
        (``reduce_scatter(all_reduce=False)``)."""
        return self._partial_reduce is not None

    def free_grad(self) -> None:
        """Release the unsharded gradient memory (storage resized to 0 in place) and drop
        any :meth:`stash_grad` stash; the next :meth:`grad_view` re-allocates it zero-filled.

        An unsharded view DBuffer handed out whose ``.grad`` is its gradient view gets
        ``.grad = None`` (``zero_grad(set_to_none=True)``), so the next backward puts a new
        gradient there (folded by the next :meth:`reduce_scatter`) instead of writing into
        freed memory."""
        self._release_grad()
        if self._grad_stash is not None:
            self._grad_stash.free()

    def _release_grad(self) -> None:
        if self._grad is None or not self._grad.allocated:
            return  # freed already, with the .grad of every view that pointed into it
        with metadata_access():
            for name in self.trainable:
                param = self._views.get(("unsharded", name))
                grad = None if param is None else param.grad
                if grad is not None and self.grad_is_view(name, grad):
                    param.grad = None
        self._grad.free()

    def free_sharded_grad(self) -> None:
        """Drop DBuffer's reference to the sharded gradients and to the views and DTensors
        it handed out over them; the next :meth:`reduce_scatter` writes a new tensor instead
        of accumulating. The memory is released when the last view of it is let go (e.g. by
        ``zero_grad(set_to_none=True)`` on parameters whose ``.grad`` is such a view)."""
        self._sharded_grad = None
        self._sharded_grad_views.clear()
        self._sharded_grad_dtensors.clear()
