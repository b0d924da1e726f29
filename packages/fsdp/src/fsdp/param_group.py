"""One ``fully_shard`` group over its DBuffers: the lifecycle verbs of a training step.

A group's parameters live in one or more :class:`dbuffer.DBuffer` (one per planner bucket and
per kind: trainable parameters of a dtype, frozen parameters of a dtype). The verbs follow
the step: :meth:`FSDPParamGroup.unshard` / :meth:`wait_for_unshard` (all-gather in place,
then register views of the unsharded buffer as the module's parameters), :meth:`reshard`
(register the sharded DTensor parameters again, free the unsharded memory),
:meth:`pre_backward` (re-gather, point every unsharded parameter's ``.grad`` at its view of
the gradient buffer so autograd accumulates straight into it), :meth:`post_backward` (one
reduce-scatter per buffer into the sharded gradient buffer) and :meth:`finish_reduce` (the
sharded ``.grad`` of every parameter becomes a RaggedShard view of that buffer).

Nothing here copies a parameter or a gradient: the collectives run on DBuffer's own buffers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from dbuffer import CollectiveHandle, DBuffer, kernels
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from fsdp.buffers import make_buffer, sharded_parameter
from fsdp.fp8 import GroupQuantizer


class TrainingState(enum.Enum):
    """Where a group or a module state is within a training step."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


@dataclass(eq=False)
class ManagedParam:
    """One parameter of a group: where it is registered and where its memory lives.

    Attributes:
        name: unique name inside the group (its DBuffer key).
        slots: every ``(module, attribute)`` that registers it (tied weights have several).
        buffer: the DBuffer holding it.
        sharded: the registered sharded parameter (a RaggedShard DTensor over the buffer).
        unsharded: the unsharded parameter (a view of the unsharded buffer), made on first
            unshard and kept, since the buffer keeps its storage across free and re-gather.
        armed: whether ``unsharded.grad`` currently is the gradient buffer's view.
        got_grad: whether autograd delivered a gradient since the last reduction.
    """

    name: str
    slots: list[tuple[nn.Module, str]]
    buffer: DBuffer
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None
    armed: bool = False
    got_grad: bool = False

    @property
    def trainable(self) -> bool:
        """Whether the parameter requires a gradient (its buffer has gradient memory)."""
        return self.sharded.requires_grad

    def register(self, param: nn.Parameter) -> None:
        """Make ``param`` the registered parameter at every slot (no ``nn.Module`` checks,
        so the swap costs a dict write per slot)."""
        for module, attr in self.slots:
            module._parameters[attr] = param

    def unsharded_param(self) -> nn.Parameter:
        """The unsharded parameter, created on first use as a view of the unsharded buffer."""
        if self.unsharded is None:
            view = self.buffer.unsharded_view(self.name)
            self.unsharded = nn.Parameter(view, requires_grad=self.sharded.requires_grad)
            if self.trainable:
                self.unsharded.register_post_accumulate_grad_hook(self._on_grad)
        return self.unsharded

    def arm_grad(self) -> None:
        """Point ``unsharded.grad`` at the gradient buffer's view, so autograd accumulates
        in place into the buffer (no per-parameter gradient tensor, no copy)."""
        assert self.unsharded is not None
        if not self.armed:
            view = self.buffer.grad_view(self.name)
            if self.unsharded.grad is not None:
                self.buffer.fold_grad(self.name, self.unsharded.grad)
            self.unsharded.grad = view
            self.armed = True

    def _on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate hook: note the gradient, and fold a gradient autograd put
        somewhere else: under ``create_graph=True`` it sets ``.grad = old + new`` out of place
        (so a replacement of the armed view already holds the view's value), and a ``.grad``
        that was ``None`` receives only the new contribution."""
        self.got_grad = True
        if not self.buffer.grad_is_view(self.name, param.grad):
            self.buffer.fold_grad(self.name, param.grad, includes_view=self.armed)
            param.grad = self.buffer.grad_view(self.name)
            self.armed = True

    def disarm_grad(self, *, reduced: bool) -> None:
        """Let go of the gradient buffer's view (its memory is about to be freed); after a
        reduction also forget that a gradient arrived."""
        if self.unsharded is not None:
            self.unsharded.grad = None
        self.armed = False
        if reduced:
            self.got_grad = False


@dataclass
class GroupConfig:
    """The per-group settings ``FSDPModule``'s setters change at run time."""

    reshard_after_forward: bool = True
    reshard_after_backward: bool = True
    reduce_grads: bool = True
    unshard_in_backward: bool = True
    reduce_scatter_unused_params: bool = False
    gradient_divide_factor: float | None = None


@dataclass
class PendingReduce:
    """A group's in-flight reduce-scatters, finished by :meth:`FSDPParamGroup.finish_reduce`."""

    group: FSDPParamGroup
    handles: list[CollectiveHandle] = field(default_factory=list)


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call and the verbs of a training step.

    Args:
        params: the managed parameters, in registration order.
        buffers: the DBuffers holding them.
        label: a readable name (the modules' class names) for profiles and errors.
        mesh: the mesh the buffers shard over.
        mp_policy: the mixed-precision policy the buffers were made with.
    """

    def __init__(self, params: list[ManagedParam], buffers: list[DBuffer], label: str,
                 mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
        self.params = params
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.buffers = buffers
        self.label = label
        self.config = GroupConfig()
        self.training_state = TrainingState.IDLE
        self.is_unsharded = False
        self.backward_armed = False
        self._gathers: list[CollectiveHandle] | None = None
        self.quantizer: GroupQuantizer | None = None  # FP8 all-gather (fsdp.fp8)
        self.post_forward_indices: list[int] = []
        self._uninitialised: dict[int, int] = {}
        # state_dict() and load_state_dict() must see the sharded parameters (a root keeps
        # its unsharded ones registered after forward), as FSDP2 ensures with the same hooks.
        for module in dict.fromkeys(m for p in params for m, _ in p.slots):
            module.register_state_dict_pre_hook(lambda *args, **kwargs: self.to_sharded())
            module._register_load_state_dict_pre_hook(lambda *args, **kwargs: self.to_sharded())

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
        (``module.weight = nn.Parameter(t)``, e.g. an init computed from other weights): copy
        this rank's run of the new values into the buffer and register the sharded parameter
        again, as FSDP2 does, instead of silently dropping the assignment."""
        for p in self.params:
            for module, attr in p.slots:
                current = module._parameters.get(attr)
                if current is p.sharded or current is None:
                    continue
                value = current.detach()
                local = p.buffer.local_view(p.name)
                with torch.no_grad():
                    if isinstance(value, DTensor) and value.placements == p.sharded.placements:
                        local.copy_(value.to_local().reshape(-1))
                    else:
                        if isinstance(value, DTensor):
                            value = value.full_tensor()
                        start, end = p.buffer.plan.local_range(p.name, p.buffer.rank)
                        local.copy_(value.reshape(-1)[start:end])
                p.register(p.sharded)

    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather of every buffer in place (a no-op when already unsharded or
        gathering). With ``async_op`` the collectives overlap whatever runs until
        :meth:`wait_for_unshard` (gloo runs them on its own thread).

        Raises:
            RuntimeError: for parameters built on the meta device and never written (the
                same on every rank).
        """
        if self._gathers is not None or self.is_unsharded:
            return
        self._adopt_assigned_params()
        if self._uninitialised:
            self._check_initialised()
        if not self.config.unshard_in_backward and self.training_state == TrainingState.PRE_BACKWARD:
            return
        with record_function(f"FSDP::all_gather ({self.label})"):
            if self.quantizer is not None:
                self._gathers = [self.quantizer.all_gather(b) for b in self.buffers]
            else:
                self._gathers = [b.all_gather(async_op=True) for b in self.buffers]
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish the all-gather and register the unsharded parameters."""
        if self._gathers is None:
            return
        with record_function(f"FSDP::wait_for_unshard ({self.label})"):
            for handle in self._gathers:
                handle.wait()
            self._gathers = None
            for p in self.params:
                p.register(p.unsharded_param())
        self.is_unsharded = True

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded memory (honouring
        ``reshard_after_forward`` during forward)."""
        if self.training_state == TrainingState.FORWARD and not self.config.reshard_after_forward:
            return
        self.to_sharded()

    def to_sharded(self) -> None:
        """Reshard now, whatever the step: for ``FSDPModule.reshard()``, state dicts and
        ``_apply``, which must see the sharded parameters."""
        self.wait_for_unshard()
        if not self.is_unsharded:
            return
        for p in self.params:
            p.register(p.sharded)
        for b in self.buffers:
            b.free_unsharded()
        self.is_unsharded = False

    # ------------------------------------------------------------------------- forward
    def pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                    register_post_backward: Callable[[FSDPParamGroup, tuple[Any, ...], dict[str, Any]],
                                                     tuple[tuple[Any, ...], dict[str, Any]]]
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Unshard for the forward and, when autograd records, hook the inputs so that the
        backward through this group ends in :meth:`post_backward`."""
        entering = self.training_state != TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()
        if entering and torch.is_grad_enabled() and any(p.trainable for p in self.params):
            self.backward_armed = True
            args, kwargs = register_post_backward(self, args, kwargs)
        return args, kwargs

    def post_forward(self, order: list[FSDPParamGroup]) -> None:
        """Reshard after forward when configured; record the group's place in ``order``
        (backward prefetches in reverse)."""
        self.reshard()
        self.post_forward_indices.append(len(order))
        order.append(self)
        self.training_state = TrainingState.IDLE

    # ------------------------------------------------------------------------ backward
    def pre_backward(self) -> None:
        """Re-gather when resharded and aim autograd at the gradient buffer."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        self.wait_for_unshard()
        if self.is_unsharded:
            for p in self.params:
                if p.trainable:
                    p.arm_grad()

    def post_backward(self) -> PendingReduce | None:
        """The group's gradients are complete: reduce-scatter them (asynchronously) unless
        gradient sync is off, and reshard after backward when configured.

        Returns:
            The pending reduction, or ``None`` when nothing is reduced.
        """
        if self.training_state == TrainingState.POST_BACKWARD:
            return None
        self.training_state = TrainingState.POST_BACKWARD
        if not self.config.reduce_grads or not self.backward_armed:
            if self.backward_armed:
                self._stash_grads()
            if self.config.reshard_after_backward:
                self.reshard()
            return None
        pending = PendingReduce(self)
        with record_function(f"FSDP::post_backward_reduce ({self.label})"):
            for buffer in self.trainable_buffers:
                self._prepare_sharded_grad(buffer)
                op = "avg"
                if self.config.gradient_divide_factor is not None:
                    kernels.scale_(buffer.grad_buffer, 1.0 / self.config.gradient_divide_factor)
                    op = "sum"
                pending.handles.append(buffer.reduce_scatter(op, async_op=True))
        if self.config.reshard_after_backward:
            self.reshard()
        return pending

    def _stash_grads(self) -> None:
        """Without gradient sync, keep the accumulated gradients in ``reduce_dtype`` when it
        is wider than the compute dtype (as FSDP2 does), in DBuffer's stash."""
        for buffer in self.trainable_buffers:
            if buffer.reduce_dtype != buffer.compute_dtype and buffer.has_grad:
                for p in self._params_of(buffer):
                    p.disarm_grad(reduced=False)
                buffer.stash_grad()

    def _params_of(self, buffer: DBuffer) -> Iterator[ManagedParam]:
        return (p for p in self.params if p.buffer is buffer)

    def _prepare_sharded_grad(self, buffer: DBuffer) -> None:
        """Make the sharded gradient buffer hold what each parameter's ``.grad`` says, so the
        reduce-scatter can add into it: FSDP accumulates into an existing sharded gradient,
        and a ``.grad`` set to ``None`` (``zero_grad()``) or replaced by the user must count
        as zero or as the user's values."""
        params = [p for p in self._params_of(buffer) if p.trainable]
        if not buffer.has_sharded_grad:
            return
        if all(p.sharded.grad is None for p in params):
            buffer.free_sharded_grad()
            return
        with torch.no_grad():
            for p in params:
                grad = p.sharded.grad
                if grad is None:
                    buffer.sharded_grad_view(p.name).zero_()
                elif grad is not buffer.sharded_grad(p.name):
                    local = grad.to_local() if hasattr(grad, "to_local") else grad
                    buffer.sharded_grad_view(p.name).copy_(local.reshape(-1))

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for the reduce-scatters, expose the sharded gradients and free the
        unsharded gradient memory."""
        with record_function(f"FSDP::post_backward_wait ({self.label})"):
            for handle in pending.handles:
                handle.wait()
        for p in self.params:
            if not p.trainable:
                continue
            keep = p.got_grad or self.config.reduce_scatter_unused_params or p.sharded.grad is not None
            p.sharded.grad = p.buffer.sharded_grad(p.name) if keep else None
            p.disarm_grad(reduced=True)
        for buffer in self.trainable_buffers:
            buffer.free_grad()

    def rebind_after_apply(self) -> None:
        """After ``nn.Module._apply`` swapped new tensors into the sharded parameters: move
        their values into the DBuffers (a new DBuffer when the dtype or device changed) and
        make every parameter a view of its buffer again."""
        with torch.no_grad():
            for index, buffer in enumerate(self.buffers):
                params = list(self._params_of(buffer))
                local = params[0].sharded._local_tensor
                target = buffer
                if (local.dtype, local.device) != (buffer.dtype, buffer.device):
                    target = make_buffer(buffer.plan, self.mesh, device=local.device,
                                         dtype=local.dtype, mp_policy=self.mp_policy,
                                         trainable=bool(buffer.trainable))
                    self.buffers[index] = target
                for p in params:
                    new_local = p.sharded._local_tensor
                    view = target.local_view(p.name)
                    if new_local.data_ptr() != view.data_ptr() or new_local is not view:
                        view.copy_(new_local.reshape(-1))
                    if target is buffer:
                        p.sharded._local_tensor = view
                    else:
                        torch.utils.swap_tensors(
                            p.sharded, sharded_parameter(target, p.name, p.sharded.requires_grad))
                        p.buffer, p.unsharded, p.armed = target, None, False
                    p.register(p.sharded)

    def reset_iter_state(self) -> None:
        """Forget a failed iteration: finish in-flight gathers, drop unsharded gradients,
        register the sharded parameters."""
        if self._gathers is not None:
            for handle in self._gathers:
                handle.wait()
            self._gathers = None
            self.is_unsharded = True
        self.training_state = TrainingState.IDLE
        self.backward_armed = False
        self.post_forward_indices.clear()
        self.reshard()
        for p in self.params:
            if p.trainable:
                p.disarm_grad(reduced=True)
        for buffer in self.trainable_buffers:
            buffer.free_grad()


