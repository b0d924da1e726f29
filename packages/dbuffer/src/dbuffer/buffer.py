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

This file holds the construction, the layout, the sharded parameters and the collectives'
configuration; the unsharded parameters' lifecycle (all-gather, free, a smaller group's piece)
is in ``unsharded.py`` and the gradients' (views, folding, reduce-scatter, stash, sharded
gradients) in ``gradients.py``, mixed into :class:`DBuffer`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping

import torch
import torch.distributed as dist
from layout_planner import Plan, PlanEntry
from ragged_dtensor import RaggedShard, from_local_run
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from dbuffer.collectives import (
    AllGatherComm,
    GroupMemory,
    ReduceScatterComm,
    allocate,
    check_comm,
)
from dbuffer.errors import check_cast, check_consistent, check_dtype, check_gradient_dtype
from dbuffer.flat import FlatBuffer
from dbuffer.gradients import Gradients
from dbuffer.topology import Topology
from dbuffer.unsharded import UnshardedParams


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


class DBuffer(UnshardedParams, Gradients):
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
        self._sharded = FlatBuffer(plan.shard_size, dtype, self.device,
                                   "sharded parameter buffer", allocated=True)
        self._all_gather_comm: AllGatherComm | None = None
        self._reduce_scatter_comm: ReduceScatterComm | None = None
        self._group_memory = False
        self._separate_reduce_scatter_group: dist.ProcessGroup | None = None
        self._views: dict[tuple[str, str], torch.Tensor] = {}
        self._dtensors: dict[tuple[str, str], DTensor] = {}
        self._init_unsharded()
        self._init_gradients()
        self._warn_reserved(stacklevel=4)

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
