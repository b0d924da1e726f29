"""The hooks that drive a group through a step: module forward hooks and autograd hooks.

One :class:`FSDPState` per ``fully_shard`` call. Its forward pre-hook unshards the group
(prefetching the next one), its forward hook reshards and hooks the outputs so the backward
re-gathers first; an autograd function on the inputs calls the group's post-backward once
the module's backward is done, and a callback queued on the autograd engine finishes the
step at the root: groups whose post-backward never ran are reduced, in-flight
reduce-scatters are awaited, and every group is resharded. The first state to run forward
is the root; it initialises the shared context of every state below it lazily, as FSDP2 does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from dbuffer import scope
from torch.autograd import Variable
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.utils import _apply_to_tensors
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp.param_group import FSDPParamGroup, TrainingState, in_backward

_STATE_ATTR = "_fsdp_ragged_state"


@dataclass
class StepContext:
    """What every state of one root shares for the current step."""

    all_states: list[FSDPState] = field(default_factory=list)
    iter_forward_root: FSDPState | None = None
    final_callback_queued: bool = False
    is_last_backward: bool = True
    post_forward_order: list[FSDPParamGroup] = field(default_factory=list)
    forward_order: list[FSDPParamGroup] = field(default_factory=list)
    forward_order_complete: bool = False
    reducing: list[FSDPParamGroup] = field(default_factory=list)
    # Backward prefetches waiting for the reduction in flight to finish.
    prefetching: list[FSDPParamGroup] = field(default_factory=list)
    # Groups in their backward whose tail stages wait for a nested group's backward to start
    # (FSDPParamGroup.reduce_before_children).
    awaiting_children: list[FSDPParamGroup] = field(default_factory=list)
    # FSDP2's post-optimizer event (FSDPModule.set_post_optim_event), used once.
    post_optim_event: Any = None

    def wait_post_optim_event(self) -> None:
        """At the root's pre-forward, before the first all-gather: make the current stream
        wait on the event the user recorded after the optimizer step, then drop it (FSDP2
        uses each event once). fsdp enqueues its collectives from the current stream, which
        already orders them after everything issued on it; the wait adds the order of an
        optimizer step run on another stream. On CPU the events are ``None``."""
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:
            event.wait()

    def finish_reduces(self) -> None:
        """Finish every reduction still in flight, then issue the backward prefetches that
        waited."""
        self.finish_reductions()
        self.issue_prefetches()

    def finish_reductions(self) -> None:
        """Finish every reduction still in flight (at a group's first gradient: the previous
        group's gradient buffer is released before the next one is allocated)."""
        while self.reducing:
            self.reducing.pop(0).finish_reduce()

    def issue_prefetches(self) -> None:
        """Start the backward prefetches that wait (see :meth:`prefetch_for_backward`)."""
        while self.prefetching:
            _prefetch_for_backward(self.prefetching.pop(0))

    def prefetch_for_backward(self, group: FSDPParamGroup, *, now: bool = False) -> None:
        """Queue ``group``'s all-gather for the backward; it starts once half of the current
        group's gradients were accumulated (:meth:`FSDPParamGroup.grad_accumulated`), at the
        current group's post-backward at the latest. The gathered parameters then never
        coexist with the previous group's gradient buffer, nor with the current group's
        activations at their peak (its first gradient), and the gather still overlaps the
        second half of the current group's backward: FSDP1's trade between its
        ``BACKWARD_PRE`` and ``BACKWARD_POST`` prefetch. ``now`` (the current group's
        ``set_backward_prefetch_start("pre_backward")``) starts it at once unless a reduction
        is in flight (then at the current group's first gradient, when that reduction has
        finished): more overlap, more memory."""
        if now and not self.reducing:
            self.drop_prefetch(group)
            _prefetch_for_backward(group)
        elif group not in self.prefetching:
            self.prefetching.append(group)

    def drop_prefetch(self, group: FSDPParamGroup) -> None:
        """Forget a queued prefetch of ``group`` (its own pre-backward gathers it now)."""
        if group in self.prefetching:
            self.prefetching.remove(group)

    def track_reduction(self, group: FSDPParamGroup) -> None:
        """``group`` started a reduction (at its post-backward, or an early one,
        :meth:`FSDPParamGroup._reduce_early`): it is the reduction in flight, finished
        before the next allocation of gradient memory, by any group (the root's output head
        is reduced before the blocks' backward, whose first gradient then finishes it);
        at once where the group's ``reduce_in_flight`` is off."""
        if not group.config.reduce_in_flight:
            group.finish_reduce()
        elif group not in self.reducing:
            self.reducing.append(group)

    def child_backward_starts(self, group: FSDPParamGroup) -> None:
        """``group``'s backward starts: the groups whose tail stages wait for it (they enclose
        it) reduce them first, before ``group`` gathers anything."""
        waiting = [g for g in self.awaiting_children if g is not group]
        self.awaiting_children = [g for g in self.awaiting_children if g is group]
        for g in waiting:
            g.reduce_before_children()

    def post_backward(self, group: FSDPParamGroup, *, last: bool | None = None) -> None:
        """Run ``group``'s post-backward (its ``finalize_backward`` at the end of a backward,
        when ``last`` is given) with at most one reduction in flight: the previous one
        finishes before this one starts, so at most one unsharded gradient buffer is being
        reduced while the next group's backward runs; none stays in flight when the group's
        ``reduce_in_flight`` is off."""
        self.finish_reduces()
        if last is None:
            group.post_backward()
        else:
            group.finalize_backward(last=last)
        if group.reduce_pending:
            self.track_reduction(group)

    def queue_final_callback(self) -> None:
        """Have autograd call :meth:`end_backward` once, when the current backward ends."""
        if self.final_callback_queued:
            return
        self.final_callback_queued = True
        Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """The end of a backward: every group finalizes its backward (reducing what the
        backward left unreduced), all reductions finish, and the per-pass state resets; the
        forward order used for prefetching is kept unless this was the step's last backward
        (``set_is_last_backward``)."""
        last = self.is_last_backward
        with scope("FSDP::root_post_backward_callback"):
            for state in reversed(self.all_states):
                for group in state.groups:
                    self.post_backward(group, last=last)
                state.training_state = TrainingState.IDLE
                state._modules_to_run_forward.clear()
            self.finish_reduces()
            if last:
                self.post_forward_order.clear()
            self.iter_forward_root = None
            self.final_callback_queued = False
            self.awaiting_children.clear()


def get_state(module: nn.Module) -> FSDPState | None:
    """The fsdp state of ``module``, if ``fully_shard`` was applied to it."""
    return module.__dict__.get(_STATE_ATTR)


class FSDPState:
    """The hooks of one ``fully_shard`` call (one module, or several in the list form).

    Args:
        modules: the modules of the call.
        group: their parameter group (``None`` when they own no parameters).
        mp_policy: the mixed-precision policy (input and output casts).
        auto_reshard_after_forward: whether ``reshard_after_forward`` was left to default
            (``False`` for the root, decided lazily).
    """

    def __init__(self, modules: tuple[nn.Module, ...], group: FSDPParamGroup | None,
                 mp_policy: MixedPrecisionPolicy, auto_reshard_after_forward: bool) -> None:
        self.modules = modules
        self.group = group
        if group is not None:
            group.before_grad_memory = lambda: self.ctx.finish_reductions()
            group.prefetch_point_reached = lambda: self.ctx.issue_prefetches()
            group.reduction_started = lambda: self.ctx.track_reduction(group)
        self.mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root: bool | None = None
        self.ctx = StepContext()
        self.training_state = TrainingState.IDLE
        self.states_to_forward_prefetch: list[FSDPState] | None = None
        self.states_to_backward_prefetch: list[FSDPState] | None = None
        self._modules_to_run_forward: set[nn.Module] = set()
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._module_pre_forward, prepend=True,
                                             with_kwargs=True)
            module.register_forward_hook(self._module_post_forward, always_call=True)

    @property
    def groups(self) -> list[FSDPParamGroup]:
        """The state's parameter group as a list (empty without parameters)."""
        return [] if self.group is None else [self.group]

    # FSDP2's private names for the same facts: code written against FSDP2's state (its own
    # tests, debugging helpers) reads them. ``_modules_to_run_forward`` is the attribute itself.
    @property
    def _is_root(self) -> bool | None:
        return self.is_root

    @property
    def _state_ctx(self) -> StepContext:
        return self.ctx

    @property
    def _fsdp_param_group(self) -> FSDPParamGroup | None:
        return self.group

    # --------------------------------------------------------------------- lazy root init
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        # FSDP2's errors and words, so code written against it behaves the same.
        if len(self.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {list(self.modules)}"
                               " (the first fully_shard module to run forward is a list)")

        self._check_no_shared_params()
        self.is_root = True
        ctx = self.ctx
        for name, module in self.modules[0].named_modules():
            state = get_state(module)
            if state is None or state in ctx.all_states:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(
                        f"FSDP state has already been lazily initialized for {name}\nFSDP "
                        "requires running forward through the root module first")
                state.is_root = False
                state.ctx = ctx
            ctx.all_states.append(state)
        self._init_fqns()
        if self.auto_reshard_after_forward and self.group is not None:
            self.group.config.reshard_after_forward = False
        self._check_no_meta_params()

    def _init_fqns(self) -> None:
        """Name every group and parameter by its path from the root, for code that reads
        FSDP2's ``_module_fqn`` / ``_param_fqn``: a group of several modules gets their names
        joined by ``", "``, and a tied parameter its first name, as in FSDP2."""
        root = self.modules[0]
        by_param = {id(p.sharded): p for state in self.ctx.all_states for g in state.groups
                    for p in g.params}
        for name, param in root.named_parameters():
            if id(param) in by_param:
                by_param[id(param)]._param_fqn = name
        group_of = {module: state.group for state in self.ctx.all_states
                    if state.group is not None for module in state.modules}
        for name, module in root.named_modules():
            group = group_of.get(module)
            if group is not None:
                group._module_fqn = name if group._module_fqn is None else (
                    f"{group._module_fqn}, {name}")

    def _check_no_shared_params(self) -> None:
        """A parameter registered in two groups (tied weights wrapped apart) would be two
        sharded copies that train apart: refuse it at the root's first forward, where FSDP2
        does, naming it by its path from the root. Every rank holds the same modules, so every
        rank raises; checked before the lazy init changes anything, so a retry raises again."""
        root = self.modules[0]
        for module in root.modules():
            state = get_state(module)
            for group in state.groups if state is not None else ():
                for p in group.params:
                    owner = group.shared_with.get(p.name)
                    if owner is not None:
                        name = self._names_from_root().get(id(p.sharded), p.name)
                        raise ValueError(
                            f"fully_shard: parameter {name!r} is already "
                            f"managed by another group (the group of {owner}); a parameter can "
                            "belong to one group only: put both modules in one group with "
                            "fully_shard([module_a, module_b])")

    def _names_from_root(self) -> dict[int, str]:
        """Each registered parameter's path from the root, by object identity (for errors)."""
        return {id(p): n for n, p in self.modules[0].named_parameters()}

    def _check_no_meta_params(self) -> None:
        """FSDP2's check and words: the first group (root first, then in module order) with
        parameters still on the meta device raises, naming them by their names in the root."""
        names = self._names_from_root()
        for state in self.ctx.all_states:
            for group in state.groups:
                # what the module holds: a value assigned in place of the sharded parameter
                # (load_state_dict(assign=True)) is taken in at the group's first unshard
                on_meta = []
                for p in group.params:
                    value = p.assigned_value()
                    value = p.sharded if value is None else value
                    if value.is_meta:
                        on_meta.append(names.get(id(value), p.name))
                if on_meta:
                    raise RuntimeError(
                        "FSDP parameters should be materialized from meta device before "
                        f"training, but the following were still on meta device: {on_meta}\n"
                        "For example, call module.to_empty(device) to materialize to device "
                        "and call module.reset_parameters() on each module to initialize values.")

    # ----------------------------------------------------------------------------- forward
    # The hooks are torch.compiler.disable-d: when a compiled region calls the module (the
    # whole sharded model compiled), dynamo must not trace the collectives and the parameter
    # swaps; it breaks the graph there, as at FSDP2's hooks.
    @torch.compiler.disable
    def _module_pre_forward(self, module: nn.Module, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if len(self.modules) > 1 and not self._modules_to_run_forward:
            self._modules_to_run_forward.update(self.modules)
        return self.pre_forward(args, kwargs)

    @torch.compiler.disable
    def _module_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if len(self.modules) > 1:
            if module not in self._modules_to_run_forward:
                return self._cast_output(output)
            self._modules_to_run_forward.discard(module)
            if self._modules_to_run_forward:
                return self._cast_output(output)
        return self.post_forward(output)

    def pre_forward(self, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Unshard (and prefetch the next group) before the module runs."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            # A forward inside backward (activation checkpointing recomputes it).
            for group in self.groups:
                group.unshard()
                group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first_in_pass = self.training_state != TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        # A reentrant checkpoint recomputes its forward inside the backward, with no
        # pre-backward hook having fired (its first forward ran without grad): it is part of
        # that backward, not a new iteration, so it neither starts one nor prefetches.
        recompute = in_backward()
        if first_in_pass:
            self._lazy_init()
            if self.ctx.iter_forward_root is None and not recompute:
                self.ctx.iter_forward_root = self
                self.ctx.wait_post_optim_event()
                self.ctx.finish_reduces()
        args, kwargs = self._cast_inputs(args, kwargs)
        for group in self.groups:
            args, kwargs = group.pre_forward(
                args, kwargs, functools.partial(_register_post_backward, self.ctx))
            if self.ctx.iter_forward_root is not None and not self.ctx.forward_order_complete:
                if group not in self.ctx.forward_order:
                    self.ctx.forward_order.append(group)
        if first_in_pass and not recompute:
            self._forward_prefetch()
        return args, kwargs

    def _forward_prefetch(self) -> None:
        if self.states_to_forward_prefetch is not None:
            targets = [g for s in self.states_to_forward_prefetch for g in s.groups]
        elif self.ctx.forward_order_complete and self.group in self.ctx.forward_order:
            order = self.ctx.forward_order
            index = order.index(self.group)
            targets = order[index + 1:index + 2]
        else:
            targets = []
        for target in targets:
            if target.config.prefetch:
                with target.use_training_state(TrainingState.FORWARD):
                    target.unshard(async_op=True)

    def post_forward(self, output: Any) -> Any:
        """Reshard (when configured) and hook the outputs for the backward."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        for group in self.groups:
            group.post_forward(self.ctx.post_forward_order)
        output = self._register_pre_backward(output)
        self.training_state = TrainingState.IDLE
        if self.ctx.iter_forward_root is self:
            output = self._complete_forward(output)
        return self._cast_output(output)

    def _complete_forward(self, output: Any) -> Any:
        """At the root's post-forward: finish list groups that did not run every module,
        and reshard groups that were prefetched but never ran."""
        ctx = self.ctx
        for state in reversed(ctx.all_states):
            if state is not self and state._modules_to_run_forward:
                state._modules_to_run_forward.clear()
                output = state.post_forward(output)
        no_backward = not torch.is_grad_enabled()
        for state in ctx.all_states:
            for group in state.groups:
                if group.training_state != TrainingState.IDLE:
                    continue
                if no_backward:
                    # No backward will use the unsharded parameters (eval, no_grad): release
                    # them all, the root's too, so that named_parameters() and optimizer
                    # state dicts see the sharded parameters the optimizer holds.
                    group.to_sharded()
                elif group.config.reshard_after_forward:
                    with group.use_training_state(TrainingState.FORWARD):
                        group.reshard()
        ctx.forward_order_complete = True
        ctx.iter_forward_root = None
        return output

    def _cast_inputs(self, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self.mp_policy.param_dtype
        if not (self.mp_policy.cast_forward_inputs and dtype):
            return args, kwargs
        cast = functools.partial(_cast_floating, dtype)
        return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output
        return _apply_to_tensors(functools.partial(_cast_floating, dtype), output)

    # ---------------------------------------------------------------------------- backward
    def _register_pre_backward(self, output: Any) -> Any:
        """Hook every output tensor that requires grad, found as FSDP2 finds them (dataclasses,
        named tuples and other containers pytree does not flatten included): a backward
        through any of them must re-gather the group first."""
        if not torch.is_grad_enabled() or not self.groups:
            return output
        hooked: list[torch.Tensor] = []

        def register(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.requires_grad:
                tensor.register_hook(self._pre_backward)
                hooked.append(tensor)
            return tensor

        output = _apply_to_tensors(register, output)
        if not in_backward():
            for group in self.groups:
                group.note_forward_graph(hooked)
        # _apply_to_tensors' recursive helper is a reference cycle that keeps ``register``,
        # and so this list, alive until the garbage collector runs: emptied, it does not
        # keep the outputs' autograd graph (the step's activations) alive with it.
        hooked.clear()
        return output

    @torch.compiler.disable
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.training_state = TrainingState.PRE_BACKWARD
        self.ctx.queue_final_callback()
        now = any(g.config.backward_prefetch_start == "pre_backward" for g in self.groups)
        for group in self.groups:
            first = group.training_state != TrainingState.PRE_BACKWARD
            if first:
                self.ctx.child_backward_starts(group)
            self.ctx.drop_prefetch(group)
            group.pre_backward()
            if first and group.tail_indices:
                self.ctx.awaiting_children.append(group)
            if first and self.states_to_backward_prefetch is None:
                self._implicit_backward_prefetch(group, now)
        for state in self.states_to_backward_prefetch or ():
            for target in state.groups:
                self.ctx.prefetch_for_backward(target, now=now)
        return grad

    def _implicit_backward_prefetch(self, group: FSDPParamGroup, now: bool) -> None:
        if not group.post_forward_indices:
            return
        index = group.post_forward_indices.pop()
        if index > 0:
            self.ctx.prefetch_for_backward(self.ctx.post_forward_order[index - 1], now=now)

    def reset_iter_state(self) -> None:
        """Recover from a forward or backward that raised (see ``FSDPModule``)."""
        if self.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        ctx = self.ctx
        ctx.reducing.clear()
        ctx.prefetching.clear()
        ctx.awaiting_children.clear()
        for state in ctx.all_states or [self]:
            state.training_state = TrainingState.IDLE
            state._modules_to_run_forward.clear()
            for group in state.groups:
                group.reset_iter_state()
        ctx.post_forward_order.clear()
        ctx.iter_forward_root = None
        ctx.final_callback_queued = False


def _prefetch_for_backward(group: FSDPParamGroup) -> None:
    if group.config.prefetch:
        with group.use_training_state(TrainingState.PRE_BACKWARD):
            group.unshard(async_op=True)


def _cast_floating(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward runs the group's post-backward: the
    gradients w.r.t. a module's inputs are ready only after its parameters' gradients.

    Written in the ``ctx``-first form: ``Function.apply`` binds the arguments of a
    ``setup_context`` form through ``inspect.signature`` on every call, which makes that
    form four times slower (~24 against ~6 microseconds here, once per group per forward).
    Under ``torch.func`` transforms, which need that form, :class:`_TransformablePostBackward`
    runs instead."""

    @staticmethod
    def forward(ctx: Any, group: FSDPParamGroup, context: StepContext,  # type: ignore[override]
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.context = group, context
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        context: StepContext = ctx.context
        context.post_backward(ctx.group)
        # A backward that reached no pre-backward hook (a module of a group called outside
        # the group's forward, e.g. a chunked loss calling the head) still ends in the final
        # callback, which finishes its reductions.
        context.queue_final_callback()
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx: Any, group_tangent: Any, context_tangent: Any,
            *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Forward-mode AD (torch.autograd.forward_ad, or torch.func.jvp through the
        # subclass) passes the inputs' tangents through, like the values.
        return tuple(t.view_as(t) for t in tangents)


class _TransformablePostBackward(_PostBackward):
    """:class:`_PostBackward` in the ``setup_context`` form with a generated vmap rule, which
    ``torch.func`` transforms (``jvp``, ``vmap``) require."""

    generate_vmap_rule = True

    @staticmethod
    def forward(group: FSDPParamGroup, context: StepContext,  # type: ignore[override]
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group, ctx.context = inputs[0], inputs[1]


def _register_post_backward(context: StepContext, group: FSDPParamGroup, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return args, kwargs
    function = (_TransformablePostBackward if torch._C._are_functorch_transforms_active()
                else _PostBackward)
    outputs = function.apply(group, context, *(flat[i] for i in positions))
    for i, out in zip(positions, outputs):
        flat[i] = out
    return tree_unflatten(flat, spec)
