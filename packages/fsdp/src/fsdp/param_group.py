"""One ``fully_shard`` group over its DBuffers: the lifecycle verbs of a training step.

A group's parameters live in one or more :class:`dbuffer.DBuffer` (one per planner bucket and
per kind: trainable parameters of a dtype, frozen parameters of a dtype). The verbs follow
the step: :meth:`FSDPParamGroup.unshard` / :meth:`wait_for_unshard` (all-gather in place,
then register views of the unsharded buffer as the module's parameters), :meth:`reshard`
(register the sharded DTensor parameters again, free the unsharded memory),
:meth:`pre_backward` (re-gather; at a buffer's first gradient every unsharded parameter's
``.grad`` in it is pointed at its view of the gradient buffer, so autograd accumulates
straight into it), :meth:`post_backward` (one reduce-scatter per buffer not reduced yet),
:meth:`finish_reduce` (the sharded ``.grad`` of every parameter that got a gradient becomes a
RaggedShard view of the reduced gradients, which only the ``.grad`` tensors keep alive) and
:meth:`finalize_backward` (the group's end of a backward).

A group of several trainable buffers (split by backward order, :mod:`fsdp.backward_split`,
or by the planner to save padding) reduces each buffer as soon as all of its parameters'
gradients are accumulated in a backward, while the rest of the group's backward runs, and
frees its unsharded parameters then: the group's gradient memory and unsharded parameters
never all exist at once.

The group changes its own training state, through :meth:`use_training_state`; the identity of
every unsharded ``.grad`` is :class:`fsdp.managed_param.ManagedParam`'s alone. Nothing here
copies a parameter or a gradient in the common path: the collectives run on DBuffer's own
buffers.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from dbuffer import AllGatherComm, CollectiveHandle, DBuffer, ReduceScatterComm, kernels, scope
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp.buffers import make_buffer
from fsdp.fp8 import GroupQuantizer
from fsdp.managed_param import ManagedParam


def _outside_functorch(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` with functorch's transforms off when one is active (a first forward
    inside ``torch.func.jvp``/``vmap``): gathering and registering parameters works on the
    buffers themselves, which a transform would wrap (FSDP2 does the same)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return wrapper


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward then is a
    reentrant checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


_GRAPH_WALK_LIMIT = 4096
"""The most autograd nodes :func:`_holds_reentrant_checkpoint` visits for a group, and for
each group nested in it (a root's walk spans its blocks' graphs)."""


def _holds_reentrant_checkpoint(outputs: list[torch.Tensor], group: object,
                                limit: int = _GRAPH_WALK_LIMIT) -> bool:
    """Whether the autograd graph from ``outputs`` back to ``group``'s input boundary (its
    ``_PostBackward`` nodes; a nested group's are walked through) or to leaves holds a
    reentrant checkpoint's node; ``True`` past ``limit`` nodes."""
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if len(seen) >= limit:
            return True
        seen.add(id(node))
        name = node.name()
        if name == "CheckpointFunctionBackward":
            return True
        # a group's boundary: its _PostBackward (or _TransformablePostBackward) node
        if not (name.endswith("PostBackwardBackward") and getattr(node, "group", None) is group):
            stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _storage_refs(buffer: DBuffer) -> int:
    """References to ``buffer``'s (gathered) unsharded storage: its views, and any tensor
    autograd saved from them."""
    return torch._C._storage_Use_Count(buffer.unsharded_buffer.untyped_storage()._cdata)


class TrainingState(enum.Enum):
    """Where a group or a module state is within a training step."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


BACKWARD_PREFETCH_STARTS = ("half_gradients", "pre_backward")
"""The values of ``FSDPModule.set_backward_prefetch_start``."""


@dataclass
class GroupConfig:
    """The per-group settings ``FSDPModule``'s setters change at run time."""

    # True, False, or the size k of the group a forward reshards to (FSDP2's int).
    reshard_after_forward: bool | int = True
    reshard_after_backward: bool = True
    reduce_grads: bool = True
    all_reduce: bool = True  # HSDP: all-reduce over the replicas after the reduce-scatter
    unshard_in_backward: bool = True
    reduce_scatter_unused_params: bool = False
    gradient_divide_factor: float | None = None
    prefetch: bool = True
    # When the backward prefetch issued from this group's pre-backward starts: at half of its
    # gradients ("half_gradients") or at once, at its first gradient while a reduce-scatter is
    # in flight ("pre_backward"); one of BACKWARD_PREFETCH_STARTS.
    backward_prefetch_start: str = "half_gradients"
    reduce_in_flight: bool = True
    # FSDP2's all-reduce hook: called with each reduced flat gradient (FSDPModule.set_all_reduce_hook).
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    # FSDP2's custom collectives (FSDPModule.set_custom_all_gather / set_custom_reduce_scatter).
    all_gather_comm: AllGatherComm | None = None
    reduce_scatter_comm: ReduceScatterComm | None = None
    # FSDPModule.set_allocate_memory_from_process_group_for_comm.
    group_memory: bool = False


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call and the verbs of a training step.

    Args:
        params: the managed parameters, in registration order.
        buffers: the DBuffers holding them.
        label: a readable name (the modules' class names) for profiles and errors.
        mp_policy: the mixed-precision policy the buffers were made with.
    """

    def __init__(self, params: list[ManagedParam], buffers: list[DBuffer], label: str,
                 mp_policy: MixedPrecisionPolicy) -> None:
        self.params = params
        self.mp_policy = mp_policy
        self.buffers = buffers
        self._unfrozen: set[int] = set()  # ids of buffers built frozen, given gradients since
        self.label = label
        # The modules' path from the root, set at the root's lazy init (FSDP2's name).
        self._module_fqn: str | None = None
        self.config = GroupConfig()
        self.training_state = TrainingState.IDLE
        self.is_unsharded = False
        # Whether a forward with autograd recording ran since the last backward of a step.
        self.ran_grad_forward = False
        # Reductions in flight: each buffer with its reduce-scatter.
        self._pending: list[tuple[DBuffer, CollectiveHandle]] = []
        # Called with the group when its reduction finished (optimizer in backward).
        self.after_reduce: Callable[[FSDPParamGroup], None] | None = None
        # Called before the group allocates gradient memory (the module state finishes the
        # reduction in flight there).
        self.before_grad_memory: Callable[[], None] | None = None
        # Called after the group started an early reduction (the module state tracks it as
        # the reduction in flight, which the next allocation of gradient memory finishes).
        self.reduction_started: Callable[[], None] | None = None
        # This backward's bookkeeping, by buffer id: buffers whose .grad views are aimed,
        # each aimed buffer's parameters whose gradient has not been accumulated yet, buffers
        # already reduced, and buffers whose unsharded parameters were freed with it.
        self._aimed: set[int] = set()
        self._awaiting: dict[int, set[str]] = {}
        self._reduced_early: set[int] = set()
        self._resharded_early: set[int] = set()
        # Whether a forward recorded a reentrant checkpoint inside the group: its backward
        # may use a buffer's parameters after their gradients are complete.
        self.reentrant_inside = False
        # The fully_shard modules nested in the group's (set by fully_shard): each widens
        # the forward-graph walk of note_forward_graph by _GRAPH_WALK_LIMIT nodes.
        self.nested_groups = 0
        # Indices in self.buffers of the stages registered after the group's children (set
        # by build_group, fsdp.backward_split): reduced when a nested group's backward
        # starts (reduce_before_children), not when their gradients complete.
        self.tail_indices: list[int] = []
        # Per buffer id: the references to its unsharded storage at the end of the last
        # backward that freed it at the post-backward (none of the group's saved tensors).
        self._settled_refs: dict[int, int] = {}
        # The autograd graph task of the group's backward (set at its pre-backward); a
        # buffer whose gradients complete inside another (nested) task is not reduced early.
        self._backward_task = -1
        # Called once the group's backward reached its prefetch point (half of its gradients
        # computed, or the first with backward_prefetch_start="pre_backward"): the module
        # state starts the waiting backward prefetch there. The point, and the count so far.
        self.prefetch_point_reached: Callable[[], None] | None = None
        self._prefetch_point = 1
        self._grads_computed = 0
        # Parameters whose gradients wait in the buffers' partial HSDP sums (all_reduce off).
        self._partial_grads: set[str] = set()
        for p in params:
            p.on_grad = self.grad_computed
            p.on_accumulated = self.grad_accumulated
        # Every (module, attribute, parameter) registering a managed parameter, flat: the
        # swaps between sharded and unsharded parameters and the check for assignments run
        # several times a step over every slot, one dict access each.
        self._slots = [(module, attr, p) for p in params for module, attr in p.slots]
        self._gathers: list[CollectiveHandle] | None = None
        self._gathered_versions: list[int] = []
        self.quantizer: GroupQuantizer | None = None  # FP8 all-gather (fsdp.fp8)
        # The k-rank group of an int reshard_after_forward (fsdp.post_forward).
        # With an int reshard_after_forward: per buffer, the group it reshards to after
        # forward (None: fully).
        self.post_forward_groups: list[dist.ProcessGroup | None] | None = None
        self.post_forward_indices: list[int] = []
        self._uninitialised: dict[int, int] = {}
        # Parameters another group also manages (name -> that group's label): sharded again,
        # as FSDP2 does, and refused at the root's first forward, where FSDP2 refuses them.
        self.shared_with: dict[str, str] = {}
        # state_dict() and load_state_dict() must see the sharded parameters (a root keeps
        # its unsharded ones registered after forward), as FSDP2 ensures with the same hooks.
        for module in dict.fromkeys(m for p in params for m, _ in p.slots):
            module.register_state_dict_pre_hook(lambda *args, **kwargs: self.to_sharded())
            module._register_load_state_dict_pre_hook(functools.partial(self._before_load, module))

    def _before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     *args: Any) -> None:
        """``load_state_dict`` pre-hook of ``module``: register the sharded parameters and
        make each of ``module``'s entries one their ``copy_`` takes
        (:meth:`ManagedParam.loadable`; ``load_state_dict`` hands hooks its own copy of the
        dict)."""
        del args
        self.to_sharded()
        for slot_module, attr, p in self._slots:
            key = prefix + attr
            if slot_module is module and key in state_dict:
                state_dict[key] = p.loadable(state_dict[key])

    # ------------------------------------------------------------------ unshard / reshard
    @property
    def trainable_buffers(self) -> list[DBuffer]:
        """The buffers with gradient memory (frozen parameters live in buffers of their own)."""
        return [b for b in self.buffers if b.trainable]

    def watch_uninitialised(self, buffers: list[DBuffer]) -> None:
        """Remember buffers made for meta-device parameters with the autograd version of
        their memory: until something writes into them (``to_empty``, an init, a state dict
        load), a forward would compute on uninitialised memory, so :meth:`unshard` raises."""
        self._uninitialised = {id(b): b.sharded_buffer._version for b in buffers}

    def _check_initialised(self) -> None:
        for buffer in self.buffers:
            version = self._uninitialised.get(id(buffer))
            if version is None:
                continue
            if buffer.sharded_buffer._version == version:
                names = ", ".join(p.name for p in self._params_of(buffer))
                raise RuntimeError(
                    f"fsdp: parameters of {self.label} ({names}) were built on the meta "
                    "device and never initialised: call model.to_empty(device=...) and "
                    "initialise them (reset_parameters(), an init function, or a state dict "
                    "load) before forward")
            del self._uninitialised[id(buffer)]

    def _adopt_assigned_params(self) -> None:
        """Take in parameters the user assigned after ``fully_shard``
        (``module.weight = nn.Parameter(t)``, e.g. an init computed from other weights, or
        ``load_state_dict(assign=True)``, which torch's ``set_model_state_dict`` uses for a
        meta-device model): copy this rank's run of the new values into the buffer and
        register the sharded parameter again, as FSDP2 does, instead of silently dropping the
        assignment. A meta-device buffer whose parameters were all assigned real values gets
        its memory on their device first; one with only some assigned raises, naming the
        rest (they would hold no values)."""
        if not self._any_assigned():
            return
        for index, buffer in enumerate(list(self.buffers)):
            params = list(self._params_of(buffer))
            assigned = {p.name: value for p in params
                        if (value := p.assigned_value()) is not None}
            if not assigned:
                continue
            if buffer.device.type == "meta" and any(not v.is_meta for v in assigned.values()):
                missing = [p.name for p in params if p.name not in assigned]
                if missing:
                    raise RuntimeError(
                        f"fsdp: parameters of {self.label} were assigned real values, but these "
                        f"are still on the meta device: {', '.join(missing)}; assign them all, "
                        "or call model.to_empty(device=...) first")
                device = next(iter(assigned.values())).device
                self._rebuild_buffer(index, device, buffer.dtype)
            for p in params:
                if p.name in assigned:
                    p.adopt(assigned[p.name].detach())
                    p.register(p.sharded)

    def _any_assigned(self) -> bool:
        """Whether a slot holds something other than its sharded parameter (the fast test
        :meth:`_adopt_assigned_params` runs at every unshard, while the sharded parameters
        are registered)."""
        for module, attr, p in self._slots:
            value = module._parameters.get(attr)
            if value is not p.sharded and value is not None:
                return True
        return False

    def _register_sharded(self) -> None:
        for module, attr, p in self._slots:
            module._parameters[attr] = p.sharded

    def _register_unsharded(self) -> None:
        for module, attr, p in self._slots:
            unsharded = p.unsharded
            if unsharded is None or unsharded.requires_grad is not p.sharded.requires_grad:
                unsharded = p.unsharded_param()  # made, or its requires_grad synced
                if p.trainable and not p.buffer.requires_grad(p.name):
                    self._unfreeze(p)
            module._parameters[attr] = unsharded

    def _unfreeze(self, param: ManagedParam) -> None:
        """``param`` was frozen when ``fully_shard`` ran and requires a gradient now (FSDP2
        trains a parameter unfrozen at any time): its buffer gives it gradients from now on,
        in place (:meth:`dbuffer.DBuffer.add_trainable`), so views a pending graph holds stay
        valid. Every rank unfreezes alike in SPMD training, as FSDP2's reduce-scatter sizes
        also assume. The buffer is never reduced early (:meth:`_may_reduce_early`): it was
        not split by backward order, so whether it completes before the group's children
        run could differ across ranks."""
        param.buffer.add_trainable([param.name])
        self._unfrozen.add(id(param.buffer))

    @_outside_functorch
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather of every buffer in place (a no-op when already unsharded or
        gathering). With ``async_op`` the collectives overlap whatever runs until
        :meth:`wait_for_unshard` (gloo runs them on its own thread).

        Raises:
            RuntimeError: for parameters built on the meta device and never written (the
                same on every rank).
        """
        if self._gathers is not None:
            return
        if self.is_unsharded:
            fresh = self._gathered_versions == self._sharded_versions()
            if fresh and not self._resharded_early:
                self._register_unsharded()  # a requires_grad changed since is synced
                return
            # The sharded parameters changed since the gather (an optimizer step while the
            # group stayed unsharded): the unsharded values are stale, gather again. So
            # when some buffers were freed after their early reduction.
            self.to_sharded()
        self._adopt_assigned_params()
        if self._uninitialised:
            self._check_initialised()
        if not self.config.unshard_in_backward and self.training_state == TrainingState.PRE_BACKWARD:
            return
        with scope(f"FSDP::all_gather ({self.label})"):
            self._gathered_versions = self._sharded_versions()
            if self.quantizer is not None and not self.holds_pieces:
                self._gathers = [self.quantizer.all_gather(b) for b in self.buffers]
            else:
                self._gathers = [b.all_gather(async_op=True) for b in self.buffers]
        if not async_op:
            self.wait_for_unshard()

    def _sharded_versions(self) -> list[int]:
        return [b.sharded_buffer._version for b in self.buffers]

    @_outside_functorch
    def wait_for_unshard(self) -> None:
        """Finish the all-gather and register the unsharded parameters."""
        if self._gathers is None:
            return
        with scope(f"FSDP::wait_for_unshard ({self.label})"):
            for handle in self._gathers:
                handle.wait()
            self._gathers = None
            self._register_unsharded()
        self.is_unsharded = True

    @_outside_functorch
    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded memory (honouring
        ``reshard_after_forward`` during forward: an int keeps each rank's piece for the
        smaller group's gather in backward)."""
        if self.training_state == TrainingState.FORWARD:
            after = self.config.reshard_after_forward
            if after is False:
                return
            if after is not True and self.post_forward_groups is not None:
                self._reshard_to_pieces()
                return
        self.to_sharded()

    def _reshard_to_pieces(self) -> None:
        self.wait_for_unshard()
        if not self.is_unsharded:
            return
        assert self.post_forward_groups is not None
        self._register_sharded()
        for b, group in zip(self.buffers, self.post_forward_groups):
            if group is None:
                b.free_unsharded()
            else:
                b.reshard_to_group(group)
        self.is_unsharded = False

    @property
    def holds_pieces(self) -> bool:
        """Whether the buffers hold pieces for a smaller group's gather (after a forward
        with an int ``reshard_after_forward``)."""
        return any(b.piece_numel for b in self.buffers)

    @_outside_functorch
    def to_sharded(self) -> None:
        """Reshard now, whatever the step: for ``FSDPModule.reshard()``, state dicts and
        ``_apply``, which must see the sharded parameters."""
        self.wait_for_unshard()
        self._resharded_early.clear()
        if not self.is_unsharded:
            for b in self.buffers:
                b.free_unsharded()  # drops pieces kept for a smaller group
            return
        self._register_sharded()
        for b in self.buffers:
            b.free_unsharded()
        self.is_unsharded = False

    @contextmanager
    def use_training_state(self, state: TrainingState) -> Iterator[None]:
        """Be in ``state`` for the block (e.g. a prefetch issued for the forward or the
        backward, whose ``unshard`` honours ``unshard_in_backward``), then return to the
        previous state, also when the block raises."""
        previous, self.training_state = self.training_state, state
        try:
            yield
        finally:
            self.training_state = previous

    # ------------------------------------------------------------------------- forward
    def pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                    register_post_backward: Callable[[FSDPParamGroup, tuple[Any, ...], dict[str, Any]],
                                                     tuple[tuple[Any, ...], dict[str, Any]]]
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Unshard for the forward and, when autograd records, hook the inputs so that the
        backward through this group ends in :meth:`post_backward`. A reduction of this
        group still in flight is finished first: the next backward accumulates into the
        gradient buffer that reduction reads."""
        entering = self.training_state != TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        self.finish_reduce()
        self.unshard()
        self.wait_for_unshard()
        if entering and torch.is_grad_enabled() and any(p.trainable for p in self.params):
            self.ran_grad_forward = True
            args, kwargs = register_post_backward(self, args, kwargs)
        return args, kwargs

    def post_forward(self, order: list[FSDPParamGroup]) -> None:
        """Reshard after forward when configured and record the group's place in ``order``
        (backward prefetches in reverse), unless the forward ran inside a backward (a
        reentrant checkpoint's recompute, whose backward follows at once and whose place in
        the order was recorded by the first forward)."""
        if not in_backward():
            self.reshard()
            self.post_forward_indices.append(len(order))
            order.append(self)
        self.training_state = TrainingState.IDLE

    # ------------------------------------------------------------------------ backward
    def pre_backward(self) -> None:
        """Re-gather when resharded. The gradient buffer is allocated later, when the first
        gradient of the group arrives (:meth:`aim_grads`)."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self._backward_task = torch._C._current_graph_task_id()
        self.finish_reduce()
        self.unshard()
        self.wait_for_unshard()

    def grad_computed(self, param: ManagedParam) -> None:
        """The gradient of ``param``, the parameter whose gradient arrived first in its buffer
        in the last backward (:meth:`ManagedParam.hook_first_grad`), was computed and is
        about to be accumulated: the buffer is aimed now (:meth:`aim_grads`), so the gradient
        lands in place. A buffer reduced early in this backward is reopened first
        (:meth:`_late_gradient`)."""
        if id(param.buffer) in self._reduced_early:
            self._late_gradient(param)
        self.aim_grads(param.buffer)

    def aim_grads(self, buffer: DBuffer,
                  landed: tuple[ManagedParam, torch.Tensor | None] | None = None) -> None:
        """Before the first gradient of ``buffer`` in a backward is accumulated: finish the
        reductions in flight (the previous group's at this group's first gradient, and this
        group's own early ones, so their gradient memory is released before more is
        allocated; they overlapped the backward up to here) and aim every parameter's
        ``.grad`` in the buffer at the gradient buffer, so autograd accumulates in place.

        ``landed``: a parameter whose gradient autograd already accumulated elsewhere (the
        buffer was not aimed), with that ``.grad`` as it was then. Finishing a reduction
        drops the ``.grad`` of every parameter of the reduced buffers, ``landed``'s too when
        the buffer's own reduction is in flight, so it is given back before being copied in."""
        if id(buffer) in self._aimed:
            return
        first = not self._aimed
        if first and self.before_grad_memory is not None:
            self.before_grad_memory()
        self.finish_reduce()
        if landed is not None:
            param, grad = landed
            param.unsharded.grad = grad
        self._aimed.add(id(buffer))
        waiting = self._awaiting[id(buffer)] = set()
        for p in self._params_of(buffer):
            # the unsharded parameter's flag: what autograd follows (a parameter unfrozen
            # after this backward's forward gets no gradient from it)
            if p.unsharded is not None and p.unsharded.requires_grad:
                p.aim_grad()
                waiting.add(p.name)
        if first:
            pre_backward = self.config.backward_prefetch_start == "pre_backward"
            gathered = sum(1 for p in self.params if p.trainable and p.unsharded is not None)
            self._prefetch_point = 1 if pre_backward else (gathered + 1) // 2

    def grad_accumulated(self, param: ManagedParam) -> None:
        """Autograd accumulated ``param``'s gradient.

        A gradient that landed before its buffer was aimed (the first backward, or another
        parameter came first this time) is in a fresh ``.grad``: the buffer is aimed now,
        which copies it in, and ``param`` becomes the buffer's hooked parameter
        (:meth:`ManagedParam.hook_first_grad`). When half of the group's trainable parameters
        have had their gradient (the first, with ``backward_prefetch_start="pre_backward"``),
        :attr:`prefetch_point_reached` runs.

        Why half: the backward prefetch of the next group waits until then (see
        :meth:`fsdp.state.StepContext.prefetch_for_backward`). At a group's first gradient its
        activations are all still alive and its gradient buffer has just been allocated; by the
        middle of its backward the activations it freed make room for the gathered group,
        which still has the second half of the backward to arrive.

        When the gradient completes its buffer, in the graph task of the group's backward (a
        nested task, like a reentrant checkpoint's, may still run nodes that use the buffer's
        parameters), while other buffers of the group still wait for gradients, the buffer is
        reduced now (:meth:`_reduce_early`) instead of at the group's post-backward."""
        key = id(param.buffer)
        late = key in self._reduced_early
        if late or key not in self._aimed:
            # Kept as it is now: the reductions finished on the way drop it (see aim_grads).
            landed = (param, param.unsharded.grad)
            if late:
                self._late_gradient(param)
            self.aim_grads(param.buffer, landed=landed)
            if not late:
                for p in self._params_of(param.buffer):
                    if p.trainable:
                        p.hook_first_grad(p is param)
        self._grads_computed += 1
        if self._grads_computed == self._prefetch_point and self.prefetch_point_reached is not None:
            self.prefetch_point_reached()
        waiting = self._awaiting.get(key)
        if waiting is None:
            return
        waiting.discard(param.name)
        if (not waiting and torch._C._current_graph_task_id() == self._backward_task
                and self._may_reduce_early(param.buffer)):
            self._reduce_early(param.buffer)

    def _may_reduce_early(self, buffer: DBuffer) -> bool:
        """Only in a backward that reached the group's pre-backward, with gradient sync on,
        not for HSDP partial sums (``set_requires_all_reduce(False)``), which wait for a
        later backward's all-reduce, and not when a reentrant checkpoint is inside the group
        (:meth:`note_forward_graph`: its nested backward may bring a late gradient).

        Only the first buffer not reduced yet, and only while a later one is left: every
        rank then issues the group's reduce-scatters in buffer order, each once per backward,
        whichever of its parameters got gradients (an expert that received no tokens on one
        rank leaves its buffer incomplete there, and the buffer is reduced at the group's
        post-backward instead). Not with ``set_reduce_scatter_unused_params(True)`` either,
        which FSDP2 asks for exactly such control flow: there the time of a reduction would
        differ across ranks, and NCCL can deadlock when ranks interleave collectives of
        different communicators (an expert-parallel all-to-all) in different orders."""
        if (not self._may_reduce_before_post_backward(buffer) or self._is_tail(buffer)
                or id(buffer) in self._unfrozen):
            return False
        left = [b for b in self.trainable_buffers if id(b) not in self._reduced_early]
        return len(left) > 1 and left[0] is buffer

    def _may_reduce_before_post_backward(self, buffer: DBuffer) -> bool:
        """The conditions of :meth:`_may_reduce_early` that every rank shares."""
        return not (self.training_state != TrainingState.PRE_BACKWARD
                    or not self.config.reduce_grads
                    or self._partial(buffer)
                    or self.reentrant_inside or self.config.reduce_scatter_unused_params
                    or buffer.has_grad_stash or buffer.has_partial_reduce)

    def _partial(self, buffer: DBuffer) -> bool:
        """Whether ``buffer``'s reduction stops at partial sums: HSDP with the replicas'
        all-reduce turned off (``set_requires_all_reduce(False)``)."""
        return not self.config.all_reduce and is_replicated(buffer)

    def _is_tail(self, buffer: DBuffer) -> bool:
        return any(self.buffers[i] is buffer for i in self.tail_indices)

    def reduce_before_children(self) -> None:
        """A group nested in this one starts its backward: reduce-scatter the stages of the
        parameters registered after the children (:attr:`tail_indices`; a root's head and
        final norm) now, each as :meth:`_reduce_early` does, whether or not all their
        gradients arrived on this rank (a missing one reads as zero, as at a post-backward).

        Why here and not when their gradients complete: between this group's early
        reduction and its post-backward every child's collectives run, so a rank where a
        tail parameter got no gradient (a head used on some ranks only) would issue the
        reduction after them and the others before: mismatched collectives. The first
        child's pre-backward is the same point on every rank. A gradient that still comes
        for a reduced stage (a parameter registered after the children but used before them)
        is reduced again and added (:meth:`_late_gradient`)."""
        if torch._C._current_graph_task_id() != self._backward_task:
            return
        for index in self.tail_indices:
            buffer = self.buffers[index]
            if id(buffer) not in self._reduced_early and self._may_reduce_before_post_backward(
                    buffer):
                self._reduce_early(buffer)

    def note_forward_graph(self, outputs: list[torch.Tensor]) -> None:
        """After a forward that autograd recorded (not a recompute inside backward), with
        several trainable buffers: record whether the group's part of the graph (from its
        outputs back to its inputs) holds a reentrant checkpoint. Its backward runs as a
        nested graph task that recomputes the forward from the module's registered
        parameters and may accumulate a parameter's gradient a second time, after its buffer
        looked complete: such a group reduces every buffer at its post-backward. A walk
        over more than :data:`_GRAPH_WALK_LIMIT` nodes per group (this one and those nested
        in it; more means the group's inputs were not hooked, e.g. passed in a closure)
        counts as holding one. A reentrant checkpoint whose output leaves the group only as
        a side output (kept on a module, added to the loss elsewhere) is not seen: its
        recompute then finds the freed parameters and raises
        (``fully_shard(..., backward_split=False)`` avoids that)."""
        if len(self.trainable_buffers) < 2 or self.reentrant_inside:
            return  # once seen, assumed in every forward (a module may take either path)
        limit = _GRAPH_WALK_LIMIT * (1 + self.nested_groups)
        self.reentrant_inside = _holds_reentrant_checkpoint(outputs, self, limit)

    def _reduce_early(self, buffer: DBuffer) -> None:
        """Reduce-scatter ``buffer`` now, while the rest of the group's backward runs: its
        parameters' gradients are complete (every one accumulated, so autograd has run every
        node that computed a gradient for them), and, with ``reshard_after_backward``, free
        its unsharded parameters first, when nothing else references their memory any more:
        no more references to it than at the end of an earlier backward (a node still to
        run may hold a tensor saved from it, e.g. ``weight.detach()`` used in forward, or a
        non-reentrant checkpoint's recomputed one; the first backward only measures). Then
        the backward prefetches waiting for this group's prefetch point are issued, before
        the reduce-scatter, as the group's post-backward would issue them: every rank then
        issues them before the group's reduce-scatters, whenever its buffers complete. The
        reduction is finished at the next allocation of gradient memory or at the group's
        post-backward."""
        params = list(self._params_of(buffer))
        for p in params:
            if p.trainable:
                p.collect_grad()
        if (self.config.reshard_after_backward and self.is_unsharded and self._gathers is None
                and _storage_refs(buffer) <= self._settled_refs.get(id(buffer), -1)):
            for p in params:
                p.register(p.sharded)
            buffer.free_unsharded()
            self._resharded_early.add(id(buffer))
        if self.prefetch_point_reached is not None:
            self.prefetch_point_reached()
        self._reduced_early.add(id(buffer))
        with scope(f"FSDP::post_backward_reduce ({self.label})"):
            self._pending.append((buffer, self._start_reduce(buffer)))
        if self.reduction_started is not None:
            self.reduction_started()

    def _late_gradient(self, param: ManagedParam) -> None:
        """A gradient of ``param`` arrives after its buffer was reduced in this backward (a
        nested backward the forward graph did not show, e.g. ``torch.autograd.backward``
        called from a hook): the first reduction is finished and handed to the sharded
        ``.grad``, the buffer waits for gradients again, and its second reduction adds to
        that ``.grad`` (reduction is linear, so the sum is exact up to float order).

        Raises:
            RuntimeError: under :func:`fsdp.optimizer_in_backward`, which stepped on the first
                reduction already (a second step in one backward would be wrong).
        """
        if self.after_reduce is not None:
            raise RuntimeError(
                f"fsdp: parameter {param.name!r} of {self.label} got a gradient after its "
                "buffer was reduced and stepped by optimizer_in_backward in this backward (a "
                "nested backward inside the group's?); shard this module with "
                "fully_shard(..., backward_split=False), or use the ordinary optimizer step")
        self.finish_reduce()
        self._reduced_early.discard(id(param.buffer))
        self._aimed.discard(id(param.buffer))

    def post_backward(self) -> bool:
        """The group's gradients are complete: reduce-scatter every buffer not reduced early
        in this backward (asynchronously, finished by :meth:`finish_reduce`) unless gradient
        sync is off or no parameter got a gradient in this backward, and reshard after
        backward when configured.

        Returns:
            Whether a reduction was started.
        """
        if self.training_state == TrainingState.POST_BACKWARD:
            return False
        self.training_state = TrainingState.POST_BACKWARD
        self.finish_reduce()
        reduced_early = self._reduced_early
        self._aimed, self._awaiting, self._reduced_early = set(), {}, set()
        self._grads_computed = 0
        trainable = [p for p in self.params if p.trainable]
        for p in trainable:
            p.collect_grad()
        # A buffer reduced early counts: the rest is reduced too, on every rank, whichever
        # of its parameters got gradients there.
        got_grads = bool(reduced_early) or any(p.got_grad for p in trainable) or any(
            b.has_grad_stash or b.has_partial_reduce for b in self.trainable_buffers)
        reduce_unused = self.config.reduce_scatter_unused_params and self.ran_grad_forward
        if not self.config.reduce_grads or not (got_grads or reduce_unused):
            if got_grads:
                self._stash_grads()
            if self.config.reshard_after_backward:
                self.reshard()
            return False
        # Reshard first: the unsharded parameters are not needed by the reduction, and the
        # collective's own staging (gloo clones its input) should not coexist with them.
        if self.config.reshard_after_backward:
            self._note_storage_refs()
            self.reshard()
        remaining = [b for b in self.trainable_buffers if id(b) not in reduced_early]
        with scope(f"FSDP::post_backward_reduce ({self.label})"):
            for buffer in remaining:  # one no gradient reached reduces zeros
                self._pending.append((buffer, self._start_reduce(buffer)))
        return bool(self._pending)

    def _note_storage_refs(self) -> None:
        """At the post-backward of a group of several trainable buffers: every node of the
        group's backward has run, so the references to each gathered buffer's unsharded
        storage now are those that stay (its views): what :meth:`_reduce_early` compares."""
        if len(self.trainable_buffers) < 2 or not self.is_unsharded:
            return
        for buffer in self.trainable_buffers:
            if buffer.is_unsharded:
                self._settled_refs[id(buffer)] = _storage_refs(buffer)

    def _start_reduce(self, buffer: DBuffer) -> CollectiveHandle:
        """Start ``buffer``'s reduce-scatter (and HSDP all-reduce), dividing as configured."""
        op = "avg"
        if self.config.gradient_divide_factor is not None:
            kernels.scale_(buffer.grad_buffer, 1.0 / self.config.gradient_divide_factor)
            op = "sum"
        # The unsharded .grad views must not outlive the gradient buffer, which the
        # reduction may release as soon as it is cast into the reduce dtype.
        for p in self._params_of(buffer):
            p.release_grad(reduced=False)
        return buffer.reduce_scatter(op, async_op=True, free_grad=True,
                                     reduce_hook=self.config.all_reduce_hook,
                                     all_reduce=self.config.all_reduce)

    def _stash_grads(self) -> None:
        """Without gradient sync, keep the accumulated gradients in ``reduce_dtype`` when it
        is wider than the compute dtype (as FSDP2 does), in DBuffer's stash."""
        for buffer in self.trainable_buffers:
            if buffer.reduce_dtype != buffer.compute_dtype and buffer.has_grad:
                for p in self._params_of(buffer):
                    p.release_grad(reduced=False)
                buffer.stash_grad()

    @property
    def fsdp_params(self) -> list[ManagedParam]:
        """The managed parameters under FSDP2's name for them."""
        return self.params

    def _params_of(self, buffer: DBuffer) -> Iterator[ManagedParam]:
        return (p for p in self.params if p.buffer is buffer)

    @property
    def reduce_pending(self) -> bool:
        """Whether a reduction the group started is not finished yet."""
        return bool(self._pending)

    def finish_reduce(self) -> None:
        """Wait for the group's reduce-scatters (if any are in flight), give every
        parameter of the reduced buffers that got a gradient its sharded ``.grad`` (running
        its post-accumulate-grad hooks), and free their unsharded gradient memory. DBuffer
        then lets go of the sharded gradients: the ``.grad`` tensors alone keep them, so
        ``zero_grad(set_to_none=True)`` frees them."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        with scope(f"FSDP::post_backward_wait ({self.label})"):
            for _, handle in pending:
                handle.wait()
        reduced = {id(buffer) for buffer, _ in pending}
        partial = {id(buffer) for buffer, _ in pending if self._partial(buffer)}
        reduce_unused = self.config.reduce_scatter_unused_params
        for p in self.params:
            if not p.trainable or id(p.buffer) not in reduced:
                continue
            if id(p.buffer) in partial:  # the sums wait for the replicas' all-reduce: no .grad
                if p.got_grad:
                    self._partial_grads.add(p.name)
            elif p.got_grad or reduce_unused or p.name in self._partial_grads:
                p.take_sharded_grad(p.sharded_grad())
            p.release_grad(reduced=True)
        if self._partial_grads:
            self._partial_grads.difference_update(
                p.name for p in self.params
                if id(p.buffer) in reduced and id(p.buffer) not in partial)
        for buffer, _ in pending:
            buffer.free_grad()
            buffer.free_sharded_grad()
        if self.after_reduce is not None:
            self.after_reduce(self)

    def finalize_backward(self, *, last: bool) -> None:
        """The end of a backward pass for this group (the root's final callback): reduce
        what the backward left unreduced (a group whose inputs needed no gradient never ran
        :meth:`post_backward`), return to idle and, after the last backward of the step,
        forget the forward order used for prefetching (1F1B keeps it across the micro-batches'
        backwards). A reduction started here is finished by the caller."""
        if self.training_state != TrainingState.POST_BACKWARD:
            self.post_backward()
        elif self.config.reshard_after_backward and self._gathers is not None:
            self.to_sharded()  # a prefetch the backward never used
        self.training_state = TrainingState.IDLE
        if last:
            self.ran_grad_forward = False
            self.post_forward_indices.clear()

    def rebind_after_apply(self) -> None:
        """After ``nn.Module._apply`` swapped new tensors into the sharded parameters: move
        their values into the DBuffers (a new DBuffer when the dtype or device changed) and
        make every parameter a view of its buffer again."""
        with torch.no_grad():
            for index, buffer in enumerate(self.buffers):
                params = list(self._params_of(buffer))
                locals_ = {p.name: p.sharded._local_tensor for p in params}
                local = locals_[params[0].name]
                target = buffer
                if (local.dtype, local.device) != (buffer.dtype, buffer.device):
                    target = self._rebuild_buffer(index, local.device, local.dtype)
                for p in params:
                    stored = p._stored(locals_[p.name])
                    view = target.local_view(p.name)
                    if stored.data_ptr() != view.data_ptr() or not stored.is_contiguous():
                        view.copy_(stored.reshape(-1))
                    if target is buffer:
                        p.sharded._local_tensor = p.local_of(view)
                    p.register(p.sharded)

    def _rebuild_buffer(self, index: int, device: torch.device, dtype: torch.dtype) -> DBuffer:
        """Replace ``self.buffers[index]`` by a new DBuffer on ``device`` in ``dtype`` (after
        ``model.to(...)``, ``to_empty`` from meta, or meta parameters assigned real values)
        and make each of its parameters a sharded parameter over the new one (the same
        Python objects, so optimizers keep them; values are the caller's to write). Collective,
        like every DBuffer construction."""
        old = self.buffers[index]
        target = make_buffer(old.plan, old.topology.mesh, device=device, dtype=dtype,
                             mp_policy=self.mp_policy, requires_grad=old.trainable)
        self.buffers[index] = target
        if id(old) in self._unfrozen:
            self._unfrozen.discard(id(old))
            self._unfrozen.add(id(target))
        target.set_custom_all_gather(self.config.all_gather_comm)
        target.set_custom_reduce_scatter(self.config.reduce_scatter_comm)
        target.set_group_memory(self.config.group_memory)
        target.set_reduce_scatter_group(old.separate_reduce_scatter_group)
        self._uninitialised.pop(id(old), None)  # the caller writes every parameter's values
        for p in list(self._params_of(old)):
            torch.utils.swap_tensors(p.sharded, p.sharded_on(target))
            p.rebind(target)
        return target

    def separate_reduce_scatter_group(self, enable: bool,
                                      created: dict[tuple[int, ...], dist.ProcessGroup]) -> None:
        """Give each buffer's reduce-scatter a process group of its own over its shard ranks
        (``created``: the groups made so far by this call, by rank set; a buffer that has one
        keeps it), or, without ``enable``, the all-gather's group again."""
        for buffer in self.buffers:
            if not enable:
                buffer.set_reduce_scatter_group(None)
                continue
            ranks = tuple(dist.get_process_group_ranks(buffer.topology.shard_group))
            if ranks not in created:
                created[ranks] = buffer.separate_reduce_scatter_group or dist.new_group(
                    list(ranks), use_local_synchronization=True,
                    group_desc="fsdp_reduce_scatter")
            buffer.set_reduce_scatter_group(created[ranks])

    def reset_iter_state(self) -> None:
        """Forget a failed iteration: finish in-flight collectives, drop the failed
        iteration's unsharded and reduced gradients, register the sharded parameters."""
        if self._gathers is not None:
            for handle in self._gathers:
                handle.wait()
            self._gathers = None
            self.is_unsharded = True
        pending, self._pending = self._pending, []
        for _, handle in pending:
            handle.wait()
        self.training_state = TrainingState.IDLE
        self.ran_grad_forward = False
        self._aimed, self._awaiting, self._reduced_early = set(), {}, set()
        self._grads_computed = 0
        self.post_forward_indices.clear()
        self.reshard()
        for p in self.params:
            if p.trainable:
                p.release_grad(reduced=True)
        for buffer in self.trainable_buffers:
            buffer.free_grad()
            buffer.free_sharded_grad()


def is_replicated(buffer: DBuffer) -> bool:
    """Whether ``buffer`` is HSDP's: its reduction ends with an all-reduce over replicas."""
    return buffer.topology.replicate_group is not None
