"""DBuffer: one FSDP group's parameters and gradients as views of flat, plan-laid-out buffers.

Four flat buffers share the layout of one :class:`layout_planner.Plan` (``W`` ranks, ``S``
elements per rank, tensor ``t`` at global offset ``l_t``):

* sharded parameters, ``S`` elements of ``dtype``, persistent: this rank's slice
  ``[r*S, (r+1)*S)`` of the global layout;
* unsharded parameters, ``W*S`` elements of ``compute_dtype``, alive between
  :meth:`DBuffer.all_gather` and :meth:`DBuffer.free_unsharded`;
* unsharded gradients, ``W*S`` elements of ``compute_dtype``, alive from the first
  :meth:`DBuffer.grad_view` (zero-filled) until :meth:`DBuffer.free_grad`;
* sharded gradients, ``S`` elements of ``dtype``, a fresh tensor written by the first
  :meth:`DBuffer.reduce_scatter` after :meth:`DBuffer.free_sharded_grad`. Unlike the others it
  is owned by reference, not freed in place: ``free_sharded_grad`` drops DBuffer's reference,
  and the memory lives exactly as long as something holds a view of it (a parameter's
  ``.grad``), so ``zero_grad(set_to_none=True)`` releases it, as in FSDP2.

Every per-tensor object handed out is a view of one of them, so the collectives run on the
buffers themselves: no copy-in, no copy-out, no ``chunk_cat``.
"""

from __future__ import annotations

import hashlib
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from layout_planner import Plan, PlanEntry
from ragged_dtensor import RaggedShard, collective_guard, from_local_run, from_local_run_like
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from dbuffer import kernels
from dbuffer.collectives import (
    AllGatherComm,
    CollectiveHandle,
    GroupMemory,
    ReduceScatterComm,
    all_gather_into,
    all_reduce_sum,
    allocate,
    check_comm,
    reduce_scatter_into,
)
from dbuffer.errors import (FreedBufferError, check_cast, check_consistent, check_dtype,
                            check_gradient_dtype)
from dbuffer.flat import FlatBuffer
from dbuffer.freed import metadata_access
from dbuffer.scopes import scope
from dbuffer.topology import Topology

ReduceOp = Literal["avg", "sum"]


def _check_plan_type(plan: object) -> None:
    """Raise a TypeError naming ``plan`` when it is not a Plan (checked before any collective)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a layout_planner.Plan, got {type(plan).__name__}")


def _requires_grad_error(requires_grad: object) -> TypeError | None:
    """A ``requires_grad`` that is not a collection of names (a bare string would otherwise be
    read as its characters), as an error to raise on every rank."""
    if requires_grad is None or (isinstance(requires_grad, Collection)
                                 and not isinstance(requires_grad, (str, bytes))
                                 and all(isinstance(n, str) for n in requires_grad)):
        return None
    return TypeError(f"requires_grad must be None or a collection of tensor names (str), got "
                     f"{type(requires_grad).__name__} {requires_grad!r}")


@dataclass(frozen=True)
class _Piece:
    """This rank's piece of the unsharded buffer kept for a smaller group's all-gather, and
    the sharded buffer's version it was cut at (a later version makes it stale)."""

    tensor: torch.Tensor
    group: dist.ProcessGroup
    sharded_version: int


class DBuffer:
    """Sharded and unsharded parameters and gradients of one FSDP group, zero-copy.

    Construction is collective: every rank of ``group`` must build its DBuffer from the same
    plan and dtypes; this is checked once with a small all-reduce of a fingerprint and an
    error flag (:func:`ragged_dtensor.raise_on_any_rank`), and a mismatch (or a local error
    such as a plan for another world size) raises on every rank.

    Args:
        plan: the layout; its ``world_size`` must equal the size of the shard group.
        group: ``None`` (default group), a process group, a 1-D device mesh, or a 2-D
            ``(replicate, shard)`` device mesh for HSDP.
        device: where the buffers live; ``"meta"`` holds no memory (a model built on the
            meta device before ``to_empty``): its collectives raise.
        dtype: the sharded master copy's dtype (also the sharded gradients'), one of
            :data:`dbuffer.SUPPORTED_DTYPES`; float8, integer and bool dtypes are moved as
            bytes and only for frozen tensors (``requires_grad=()``).
        compute_dtype: the unsharded parameters' and gradients' dtype (default ``dtype``).
        reduce_dtype: the dtype gradients are reduced in (default ``compute_dtype``).
        requires_grad: names of the trainable tensors (default: all). Frozen tensors get no
            gradient views; with none trainable no gradient memory is ever allocated. With
            some frozen, their regions of the gradient buffers stay reserved (kept at zero),
            because every trainable tensor's gradient must keep its parameter's per-rank
            ranges: the buffer warns with the bytes reserved (:attr:`frozen_grad_bytes`);
            a DBuffer of its own for the frozen tensors reserves none.

    On a group of one rank (a world of one, or a mesh dimension of size one) no collective
    runs: the all-gather and the reduce-scatter are local copies (none where the cast already
    wrote the unsharded buffer), the HSDP all-reduce a no-op, as in FSDP2.

    Raises:
        TypeError: for an unsupported dtype, a cast to or from an integer or bool dtype, or a
            byte dtype (float8, integer, bool) with trainable tensors.
        ValueError: for a plan that does not match the group, unknown ``requires_grad`` names,
            or a plan/dtype fingerprint that differs across ranks (on every rank).
    """

    def __init__(self, plan: Plan, group: dist.ProcessGroup | DeviceMesh | None = None, *,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 requires_grad: Collection[str] | None = None) -> None:
        self._build(plan, group, device=device, dtype=dtype, compute_dtype=compute_dtype,
                    reduce_dtype=reduce_dtype, requires_grad=requires_grad)

    def _build(self, plan: Plan, group: dist.ProcessGroup | DeviceMesh | None, *,
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               compute_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None,
               requires_grad: Collection[str] | None = None,
               input_error: BaseException | None = None) -> None:
        """The constructor's body; ``input_error`` (from :meth:`from_tensors`) rides the same
        single construction check as the local errors."""
        _check_plan_type(plan)
        self.plan = plan
        self.topology = Topology.resolve(group)
        self.device = torch.device(device)
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self._entries: dict[str, PlanEntry] = {e.name: e for e in plan.entries}
        names_error = _requires_grad_error(requires_grad)
        if names_error is not None:
            requires_grad = ()
        wanted = set(self._entries if requires_grad is None else requires_grad)
        self.trainable: tuple[str, ...] = tuple(n for n in self._entries if n in wanted)
        self._trainable_set = frozenset(self.trainable)
        error = names_error or self._local_error(requires_grad) or input_error
        check_consistent(error, self._fingerprint(), self.topology.groups)

        self.rank = self.topology.shard_rank
        self.world_size = plan.world_size
        # (offset in the sharded buffer, numel) of this rank's run of each tensor: asked per
        # tensor per step (views, sharded gradients), fixed by the plan and the rank.
        self._local_slices: dict[str, tuple[int, int]] = {}
        self._sharded_split_plan: tuple[list[int], dict[str, int]] | None = None
        S = plan.shard_size
        self._sharded = FlatBuffer(S, dtype, self.device, "sharded parameter buffer",
                                   allocated=True)
        self._unsharded = FlatBuffer(self.world_size * S, self.compute_dtype, self.device,
                                     "unsharded parameter buffer", allocated=False,
                                     hint="call all_gather() first")
        self._grad: FlatBuffer | None = None
        self._piece: _Piece | None = None
        # HSDP reduce-scatter sums waiting for their all-reduce (reduce_scatter(all_reduce=False)).
        self._partial_reduce: torch.Tensor | None = None
        # The sharded gradients: a plain tensor DBuffer holds from a reduce-scatter until
        # free_sharded_grad(), with the views and DTensors handed out over it; after that only
        # their holders keep the memory alive (no in-place free, nothing to fence).
        self._sharded_grad: torch.Tensor | None = None
        self._sharded_grad_views: dict[str, torch.Tensor] = {}
        self._sharded_grad_dtensors: dict[str, DTensor] = {}
        self._grad_stash: FlatBuffer | None = None
        if self.trainable:
            self._grad = FlatBuffer(self.world_size * S, self.compute_dtype, self.device,
                                    "unsharded gradient buffer", allocated=False,
                                    hint="call grad_view() or grad_buffer first")
            if self.reduce_dtype != self.compute_dtype:
                self._grad_stash = FlatBuffer(self.world_size * S, self.reduce_dtype, self.device,
                                              "gradient stash", allocated=False,
                                              hint="call stash_grad() first")
        self._all_gather_comm: AllGatherComm | None = None
        self._reduce_scatter_comm: ReduceScatterComm | None = None
        self._group_memory = False
        self._separate_reduce_scatter_group: dist.ProcessGroup | None = None
        self._views: dict[tuple[str, str], torch.Tensor] = {}
        self._dtensors: dict[tuple[str, str], DTensor] = {}
        # The last gradient fold_grad took per tensor (object and version), so the
        # reduce-scatter does not fold a parameter's ``.grad`` a hook already folded.
        self._folded: dict[str, tuple[weakref.ref[torch.Tensor], int]] = {}
        frozen = [n for n in self._entries if n not in self.trainable]
        if self.trainable and frozen:
            warnings.warn(
                f"DBuffer: {len(frozen)} frozen tensor(s) ({', '.join(frozen[:4])}"
                f"{', ...' if len(frozen) > 4 else ''}) keep {self.frozen_grad_bytes} bytes "
                "of gradient buffer space reserved on this rank (unsharded and sharded "
                "gradients; kept at zero), because gradient regions keep the parameters' "
                "layout; give frozen tensors a DBuffer of their own (requires_grad=()) to "
                "reserve none", UserWarning, stacklevel=3)

    # ----------------------------------------------------------------- construction helpers
    @classmethod
    def from_tensors(cls, named_full_tensors: Mapping[str, torch.Tensor], plan: Plan,
                     group: dist.ProcessGroup | DeviceMesh | None = None,
                     **kwargs: object) -> DBuffer:
        """Build a DBuffer and fill this rank's pieces from full (unsharded) tensors.

        Every rank passes the same full tensors (e.g. from one seeded initialisation); each
        keeps only its own pieces. This is the only per-tensor copy DBuffer makes, once.

        Args:
            named_full_tensors: one full tensor per plan entry, by name.
            plan: the layout.
            group: as for :class:`DBuffer`.
            **kwargs: the other :class:`DBuffer` keyword arguments.

        Returns:
            The filled buffer.

        Raises:
            ValueError: when the names or sizes do not match the plan (on every rank, through
                the construction check: still one small collective).
        """
        _check_plan_type(plan)
        names = {e.name for e in plan.entries}
        error: BaseException | None = None
        if not isinstance(named_full_tensors, Mapping):
            error = TypeError(f"named_full_tensors must be a mapping of name to tensor, got "
                              f"{type(named_full_tensors).__name__}")
        elif set(named_full_tensors) != names:
            missing = sorted(names - set(named_full_tensors))
            extra = sorted(set(named_full_tensors) - names)
            error = ValueError(f"named_full_tensors must hold exactly the plan's tensors: "
                               f"missing {missing}, unexpected {extra}")
        else:
            for entry in plan.entries:
                t = named_full_tensors[entry.name]
                if not isinstance(t, torch.Tensor):
                    error = TypeError(f"tensor {entry.name!r}: expected a torch.Tensor, got "
                                      f"{type(t).__name__}")
                    break
                if t.numel() != entry.numel or (entry.shape is not None
                                                 and tuple(t.shape) != tuple(entry.shape)):
                    error = ValueError(f"tensor {entry.name!r}: shape {tuple(t.shape)} does not "
                                       f"match the plan (numel {entry.numel}, shape {entry.shape})")
                    break
        buffer = cls.__new__(cls)
        buffer._build(plan, group, input_error=error, **kwargs)  # type: ignore[arg-type]
        with torch.no_grad():
            for entry in plan.entries:
                start, end = plan.local_range(entry.name, buffer.rank)
                flat = named_full_tensors[entry.name].detach().reshape(-1)
                buffer.local_view(entry.name).copy_(flat[start:end])
        return buffer

    def _local_error(self, requires_grad: Collection[str] | None) -> BaseException | None:
        try:
            check_dtype(self.dtype, "dtype")
            check_dtype(self.compute_dtype, "compute_dtype")
            check_dtype(self.reduce_dtype, "reduce_dtype")
            check_cast(self.dtype, self.compute_dtype, "compute_dtype")
            check_cast(self.compute_dtype, self.reduce_dtype, "reduce_dtype")
            if self.trainable:
                check_gradient_dtype(self.dtype, "dtype")
                check_gradient_dtype(self.compute_dtype, "compute_dtype")
                check_gradient_dtype(self.reduce_dtype, "reduce_dtype")
        except TypeError as error:
            return error
        if self.plan.world_size != self.topology.shard_size:
            return ValueError(f"plan is for world_size {self.plan.world_size} but the shard "
                              f"group has {self.topology.shard_size} ranks")
        if requires_grad is not None:
            unknown = sorted(set(requires_grad) - self._entries.keys())
            if unknown:
                return ValueError(f"requires_grad names tensors not in the plan: {unknown}")
        return None

    def _fingerprint(self) -> str:
        parts = (self.plan.fingerprint(), str(self.dtype), str(self.compute_dtype),
                 str(self.reduce_dtype), ",".join(self.trainable))
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]

    # ---------------------------------------------------------------------------- layout
    @property
    def shard_size(self) -> int:
        """``S``: elements of the sharded buffers per rank."""
        return self.plan.shard_size

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors of the buffer, in plan order."""
        return tuple(self._entries)

    def _entry(self, name: str) -> PlanEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in this DBuffer "
                           f"(tensors: {list(self._entries)})") from None

    def _shape(self, name: str) -> tuple[int, ...]:
        entry = self._entry(name)
        return tuple(entry.shape) if entry.shape is not None else (entry.numel,)

    def _local_slice(self, name: str) -> tuple[int, int]:
        cached = self._local_slices.get(name)
        if cached is not None:
            return cached
        entry = self._entry(name)
        start, end = self.plan.local_range(name, self.rank)
        local = (0, 0) if start == end else (
            entry.offset + start - self.rank * self.shard_size, end - start)
        self._local_slices[name] = local
        return local

    def _check_trainable(self, name: str) -> None:
        if name in self._trainable_set:
            return
        self._entry(name)  # an unknown name raises KeyError first
        raise ValueError(f"tensor {name!r} is frozen (not in requires_grad): it has no gradient")

    def _view(self, kind: str, name: str, buffer: FlatBuffer, offset: int, numel: int,
              shape: tuple[int, ...]) -> torch.Tensor:
        key = (kind, name)
        if key not in self._views:
            self._views[key] = buffer.view(f"{kind} view of {name!r}", offset, numel, shape)
        return self._views[key]

    # ------------------------------------------------------------------- sharded params
    @property
    def sharded_buffer(self) -> torch.Tensor:
        """The flat sharded parameter buffer (``S`` elements of ``dtype``), e.g. for fused
        optimizer steps over the whole group."""
        return self._sharded.tensor

    def local_view(self, name: str) -> torch.Tensor:
        """This rank's piece of tensor ``name``: a 1-D view of the sharded buffer.

        Args:
            name: the tensor.

        Returns:
            A 1-D view (empty when this rank owns none of the tensor).
        """
        offset, numel = self._local_slice(name)
        return self._view("local", name, self._sharded, offset, numel, (numel,))

    def _ragged_dtensor(self, name: str, local: torch.Tensor) -> DTensor:
        """The RaggedShard DTensor of tensor ``name`` around ``local`` itself (not an alias,
        which is what ``DTensor.from_local`` would store)."""
        shape = self._shape(name)
        counts = [end - start for start, end in
                  (self.plan.local_range(name, r) for r in range(self.world_size))]
        ragged = RaggedShard.from_element_counts(shape, counts)
        placements = (ragged,) if self.topology.replicate_group is None else (Replicate(), ragged)
        return from_local_run(local, self.topology.device_mesh(self.device.type), placements,
                              shape)

    def _dtensor(self, kind: str, name: str, buffer: FlatBuffer,
                 local: torch.Tensor) -> DTensor:
        """:meth:`_ragged_dtensor` over a view of ``buffer``, cached and fenced with the
        buffer's views while it is freed."""
        key = (kind, name)
        if key not in self._dtensors:
            dtensor = self._ragged_dtensor(name, local)
            buffer.track(dtensor, f"{kind} DTensor of {name!r}")
            self._dtensors[key] = dtensor
        return self._dtensors[key]

    def sharded_param(self, name: str) -> DTensor:
        """Tensor ``name`` as a RaggedShard DTensor whose local tensor is :meth:`local_view`.

        Args:
            name: the tensor.

        Returns:
            The DTensor (``(Replicate(), RaggedShard)`` on an HSDP mesh); cached per name.
        """
        dtensor = self._dtensors.get(("param", name))
        if dtensor is not None:
            return dtensor
        return self._dtensor("param", name, self._sharded, self.local_view(name))

    # ------------------------------------------------------------------ unsharded params
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

    # ------------------------------------------------------------- custom collectives
    def set_custom_all_gather(self, comm: AllGatherComm | None) -> None:
        """Run the all-gather with ``comm`` (FSDP2's ``AllGather`` interface), ``None`` for
        the default: ``comm.allocate`` then provides the unsharded parameter buffer (the
        collective's output; e.g. from a memory pool the backend registered) and
        ``comm(output_tensor=, input_tensor=, group=, async_op=)`` fills it from the shard,
        on every group size. The buffer is still freed and restored in place, so the
        parameter views handed out keep working on the comm's memory.

        Args:
            comm: the custom all-gather, or ``None``.

        Raises:
            TypeError: when ``comm`` lacks the interface.
        """
        check_comm(comm, "set_custom_all_gather")
        self._all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm | None) -> None:
        """Run the reduce-scatter with ``comm`` (FSDP2's ``ReduceScatter`` interface),
        ``None`` for the default: ``comm.allocate`` then provides every buffer the collective
        touches (the unsharded gradient buffer or the reduce-dtype copy it reads, the sharded
        gradients or the temporary it writes) and ``comm(output_tensor=, input_tensor=,
        group=, op=SUM, async_op=)`` runs it on groups of more than one rank (a one-rank
        group copies, as FSDP2 does). Averaging stays DBuffer's fused division.

        Args:
            comm: the custom reduce-scatter, or ``None``.

        Raises:
            TypeError: when ``comm`` lacks the interface.
        """
        check_comm(comm, "set_custom_reduce_scatter")
        self._reduce_scatter_comm = comm

    def set_reduce_scatter_group(self, group: dist.ProcessGroup | None) -> None:
        """Run the reduce-scatter over ``group``, a process group of its own over the shard
        group's ranks, ``None`` to share the all-gather's again: with one communicator the
        backend runs one collective at a time, with two a reduce-scatter can progress while
        an all-gather runs (FSDP2's ``set_separate_reduce_scatter_group``).

        Args:
            group: a process group over exactly the shard group's ranks, in order, or
                ``None``.

        Raises:
            ValueError: when ``group``'s ranks are not the shard group's.
        """
        if group is not None:
            ranks = dist.get_process_group_ranks(group)
            shard_ranks = dist.get_process_group_ranks(self.topology.shard_group)
            if ranks != shard_ranks:
                raise ValueError(f"set_reduce_scatter_group: the group's ranks {ranks} are not "
                                 f"the shard group's {shard_ranks}")
        self._separate_reduce_scatter_group = group

    @property
    def separate_reduce_scatter_group(self) -> dist.ProcessGroup | None:
        """The reduce-scatter's own process group (:meth:`set_reduce_scatter_group`), or
        ``None`` when it shares the all-gather's shard group."""
        return self._separate_reduce_scatter_group

    def set_group_memory(self, enable: bool) -> None:
        """Take the buffers the default collectives write and the reduce-scatter reads (the
        unsharded parameters or the FP8 all-gather's bytes, the unsharded gradients, the
        reduce-dtype copy and the reduce-scatter's output) from the process group's own
        allocator (:class:`~dbuffer.collectives.GroupMemory`; FSDP2's
        ``set_allocate_memory_from_process_group_for_comm``), from the next allocation on. A
        custom collective's ``allocate`` still comes first. The all-gather's input stays
        the sharded buffer itself (or its cast into the output), as DBuffer's copy-free
        gather has it; FSDP2 copies it into its registered output first.

        Args:
            enable: on or off.
        """
        self._group_memory = bool(enable)

    def _allocator(self, comm: AllGatherComm | ReduceScatterComm | None,
                   group: dist.ProcessGroup) -> AllGatherComm | ReduceScatterComm | GroupMemory | None:
        """What allocates a buffer of ``comm``'s collective over ``group``: the custom comm,
        the group's allocator (:meth:`set_group_memory`), or ``None`` (the device's)."""
        if comm is None and self._group_memory:
            return GroupMemory(group)
        return comm

    def _reduce_scatter_allocator(self) -> ReduceScatterComm | GroupMemory | None:
        return self._allocator(self._reduce_scatter_comm, self._reduce_scatter_group)

    @property
    def _reduce_scatter_group(self) -> dist.ProcessGroup:
        return self._separate_reduce_scatter_group or self.topology.shard_group

    def _new(self, comm: AllGatherComm | ReduceScatterComm | GroupMemory | None, numel: int,
             dtype: torch.dtype, what: str) -> Callable[[], torch.Tensor] | None:
        """How a flat buffer that ``comm``'s collective touches gets its memory (``None``:
        the device allocator)."""
        if comm is None:
            return None
        return lambda: allocate(comm, numel, dtype, self.device, what)

    def _check_on_device(self, op: str) -> None:
        """Raise before a collective on a meta-device buffer (every rank built its buffer on
        the same device, so every rank raises here)."""
        if self.device.type == "meta":
            raise RuntimeError(f"DBuffer.{op}(): the buffer is on the meta device (it holds no "
                               "values); build it on a real device or move the model there "
                               "first (e.g. model.to_empty(device=...) and initialise it)")

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

    # ------------------------------------------------------------------------ gradients
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
        self._sharded_grad_views.update((n, pieces[i]) for n, i in index.items())
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
