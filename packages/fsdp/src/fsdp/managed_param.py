"""One parameter of a ``fully_shard`` group: where it is registered, where its memory lives,
and the one owner of its unsharded gradient's identity.

The unsharded parameter's ``.grad`` is the single source of truth for its gradient, and this
class is the only code that decides what that ``.grad`` is:

* before a backward's first gradient of its buffer lands (:meth:`ManagedParam.aim_grad`) it
  becomes the gradient buffer's view, so autograd accumulates in place into the buffer (no
  per-parameter gradient, no copy). One parameter per buffer has a hook that runs before its
  gradient is accumulated (:meth:`ManagedParam.hook_first_grad`): the one whose gradient
  arrived first in the last backward, so the buffer is aimed before any gradient lands;
  should another arrive first, autograd gives it a fresh ``.grad``, which is copied in;
* autograd may still put the gradient somewhere else: a module of the group called outside
  the group's forward (a chunked loss calling the head directly) gets a fresh ``.grad`` before
  any pre-backward hook ran, ``create_graph=True`` replaces ``.grad`` by ``.grad + new``, a user
  may assign ``.grad``. Whatever tensor ``.grad`` is when the group's backward ends *is* the
  gradient, so :meth:`ManagedParam.collect_grad` copies it into the buffer and points ``.grad``
  at the view again;
* before the buffer's memory is freed, :meth:`ManagedParam.release_grad` drops ``.grad``, so a
  ``.grad`` never points into freed memory (autograd would write through it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from dbuffer import DBuffer, is_released, metadata_access
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fsdp.buffers import sharded_parameter


@dataclass(eq=False)
class ManagedParam:
    """One parameter of a group.

    Attributes:
        name: unique name inside the group (its DBuffer key).
        slots: every ``(module, attribute)`` that registers it (tied weights have several).
        buffer: the DBuffer holding it.
        sharded: the registered sharded parameter (a RaggedShard DTensor over the buffer).
        unsharded: the unsharded parameter (a view of the unsharded buffer), made on first
            unshard and kept, since the buffer keeps its storage across free and re-gather.
        got_grad: whether autograd delivered a gradient since the last reduction (FSDP2
            gives a sharded ``.grad`` only to parameters that got one).
        on_grad: the group's :meth:`~fsdp.param_group.FSDPParamGroup.grad_computed`,
            called with this parameter when a gradient of it is computed, before it is
            accumulated, while :meth:`hook_first_grad` holds the hook.
        on_accumulated: the group's
            :meth:`~fsdp.param_group.FSDPParamGroup.grad_accumulated`, called with this
            parameter once autograd accumulated its gradient.
        _param_fqn: its path from the root module, set at the root's lazy init (FSDP2's
            name for it).
    """

    name: str
    slots: list[tuple[nn.Module, str]]
    buffer: DBuffer
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None
    got_grad: bool = False
    on_grad: Callable[[ManagedParam], None] | None = None
    on_accumulated: Callable[[ManagedParam], None] | None = None
    _param_fqn: str | None = None
    _first_grad_hook: RemovableHandle | None = field(default=None, repr=False)
    _grads_hooked: bool = field(default=False, repr=False)
    # requires_grad of both parameters at the last sync (unsharded_param)
    _requires_grad: bool = field(default=False, repr=False)

    @property
    def trainable(self) -> bool:
        """Whether the parameter requires a gradient (its buffer has gradient memory)."""
        return self.sharded.requires_grad

    def assigned_value(self) -> torch.Tensor | None:
        """What a module slot holds in place of the sharded parameter (an assignment after
        ``fully_shard``, e.g. ``load_state_dict(assign=True)``), or ``None``."""
        for module, attr in self.slots:
            current = module._parameters.get(attr)
            if current is not self.sharded and current is not None:
                return current
        return None

    def register(self, param: nn.Parameter) -> None:
        """Make ``param`` the registered parameter at every slot (no ``nn.Module`` checks,
        so the swap costs a dict write per slot)."""
        for module, attr in self.slots:
            module._parameters[attr] = param

    def unsharded_param(self) -> nn.Parameter:
        """The unsharded parameter, created on first use as a view of the unsharded buffer
        (:meth:`_as_param_tensor` of it), requiring a gradient exactly when the sharded one
        does: a parameter frozen after ``fully_shard`` must get no gradient (nothing would
        reduce or clear it, and the next step would add it in), and one unfrozen gets its
        gradient hooks the first time it trains. Either parameter may have been changed
        since the last call: while the group stays unsharded the registered one, which a loop
        over ``model.parameters()`` reaches, is the unsharded one; the one changed wins."""
        if self.unsharded is None:
            # requires_grad given at creation: requires_grad_() raises under torch.func
            # transforms, where a first forward may run
            view = self._as_param_tensor(self.buffer.unsharded_view(self.name))
            self.unsharded = nn.Parameter(view, requires_grad=self.sharded.requires_grad)
        elif self.unsharded.requires_grad is not self.sharded.requires_grad:
            if self.unsharded.requires_grad is not self._requires_grad:
                self.sharded.requires_grad_(self.unsharded.requires_grad)
            else:
                self.unsharded.requires_grad_(self.sharded.requires_grad)
        self._requires_grad = self.sharded.requires_grad
        if self._requires_grad and not self._grads_hooked:
            self._hook_grads(self.unsharded)
            self._grads_hooked = True
        return self.unsharded

    def _hook_grads(self, param: nn.Parameter) -> None:
        """Register the unsharded parameter's gradient hooks (once per unsharded
        parameter): the count of arrived gradients."""
        param.register_post_accumulate_grad_hook(self._note_grad)

    def hook_first_grad(self, hooked: bool) -> None:
        """Call :attr:`on_grad` before this parameter's gradient is accumulated, or stop.

        The group hooks one parameter per buffer, the one whose gradient arrived first in
        the last backward: its hook allocates and aims the buffer before any gradient lands,
        so the buffer exists only while gradients arrive and nothing is copied. A hook on
        every parameter would do the same at the cost of one Python call per parameter per
        backward.
        """
        if hooked and self._first_grad_hook is None:
            self._first_grad_hook = self.unsharded_param().register_hook(self._before_accumulate)
        elif not hooked and self._first_grad_hook is not None:
            self._first_grad_hook.remove()
            self._first_grad_hook = None

    def rebind(self, buffer: DBuffer) -> None:
        """Live in ``buffer`` from now on (a rebuilt DBuffer): the unsharded parameter, its
        hooks with it, is made again over the new buffer at the next unshard."""
        self.buffer, self.unsharded, self._first_grad_hook = buffer, None, None
        self._grads_hooked = False

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        """The pre-accumulate hook :meth:`hook_first_grad` registers (``grad`` is unused: the
        group aims ``.grad`` so that autograd accumulates it in place)."""
        del grad
        if self.on_grad is not None:
            self.on_grad(self)

    def adopt(self, value: torch.Tensor) -> None:
        """Copy this rank's run of ``value`` (a tensor the user assigned in place of the
        parameter after ``fully_shard``) into the sharded buffer."""
        local = self.buffer.local_view(self.name)
        with torch.no_grad():
            if isinstance(value, DTensor) and value.placements == self.sharded.placements:
                local.copy_(self._stored(value.to_local()).reshape(-1))
                return
            if isinstance(value, DTensor):
                value = value.full_tensor()
            start, end = self.buffer.plan.local_range(self.name, self.buffer.rank)
            local.copy_(self._stored(value).reshape(-1)[start:end])

    # The hook points of a parameter whose unsharded form is not a plain tensor
    # (fsdp.tensor_parallel.TPManagedParam: a tensor-parallel DTensor over the same views).
    def _as_param_tensor(self, view: torch.Tensor) -> torch.Tensor:
        """What the module sees for an unsharded (parameter or gradient) view."""
        return view

    def _as_grad_tensor(self, view: torch.Tensor) -> torch.Tensor:
        """What ``.grad`` is for an unsharded gradient view: :meth:`_as_param_tensor` of it,
        unless the gradient is placed unlike the parameter (an SPMD mesh's ``Partial``)."""
        return self._as_param_tensor(view)

    def loadable(self, value: object) -> object:
        """``value``, this parameter's entry in a state dict being loaded, as the sharded
        parameter's ``copy_`` takes it (here: unchanged)."""
        return value

    def _buffer_grad(self) -> torch.Tensor:
        """The ``.grad`` that accumulates in place into the gradient buffer."""
        return self._as_grad_tensor(self.buffer.grad_view(self.name))

    def _is_buffer_grad(self, grad: torch.Tensor) -> bool:
        return self.buffer.grad_is_view(self.name, self._local(grad))

    def _local(self, grad: torch.Tensor) -> torch.Tensor:
        """The plain tensor laid out like the buffer's view, of a ``.grad``."""
        return grad

    # The hook points of a parameter stored in another order than its own
    # (fsdp.dim_shard.DimShardManagedParam: dim d first).
    def _stored(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (shaped like the parameter or its local shard) in the order the buffer
        stores it, for a flat copy into the buffer."""
        return value

    def local_of(self, view: torch.Tensor) -> torch.Tensor:
        """The sharded parameter's local tensor over the buffer's 1-D ``view`` of its run."""
        return view

    def sharded_on(self, buffer: DBuffer) -> nn.Parameter:
        """A new sharded parameter over ``buffer`` (after ``model.to(dtype)`` rebuilt it)."""
        return sharded_parameter(buffer, self.name, self.sharded.requires_grad)

    def sharded_grad(self) -> DTensor:
        """The reduced gradient to give the sharded parameter."""
        return self.buffer.sharded_grad(self.name)

    def _note_grad(self, param: torch.Tensor) -> None:
        del param
        self.got_grad = True
        if self.on_accumulated is not None:
            self.on_accumulated(self)

    # ------------------------------------------------------------- the unsharded .grad
    def aim_grad(self) -> None:
        """Point ``.grad`` at the gradient buffer's view (allocated zero-filled if freed), so
        autograd accumulates in place; a ``.grad`` autograd already made elsewhere is the
        gradient so far and is moved into the view first."""
        assert self.unsharded is not None
        grad = self.unsharded.grad
        if grad is not None and self._is_buffer_grad(grad):
            return
        target = self._buffer_grad()
        if grad is not None:
            self._copy_into(grad)
        self.unsharded.grad = target

    def collect_grad(self) -> None:
        """At the end of the group's backward: make the buffer hold what ``.grad`` says (a
        replaced or fresh ``.grad`` is copied in; ``.grad`` set to ``None`` after a gradient
        arrived reads as zero)."""
        if self.unsharded is None:
            return
        grad = self.unsharded.grad
        if grad is None:
            if self.got_grad and self.buffer.has_grad:
                self.buffer.grad_view(self.name).zero_()
                self.got_grad = False
            return
        if not self._is_buffer_grad(grad):
            self._copy_into(grad)
            self.unsharded.grad = self._buffer_grad()

    def _copy_into(self, grad: torch.Tensor) -> None:
        view = self.buffer.grad_view(self.name)
        local = self._local(grad)
        if isinstance(local, DTensor) or tuple(local.shape) != tuple(view.shape):
            expected = tuple(self._as_param_tensor(view).shape)
            raise ValueError(f"parameter {self.name!r}: its unsharded .grad must be shaped like "
                             f"the unsharded parameter, {expected}, got "
                             f"{type(grad).__name__} of shape {tuple(grad.shape)}")
        with torch.no_grad():
            if local.layout == torch.strided:
                view.copy_(local)
            else:  # a sparse gradient (nn.Embedding(sparse=True)): no dense copy_ from one
                view.zero_().add_(local)
        self.got_grad = True

    def release_grad(self, *, reduced: bool) -> None:
        """Drop ``.grad`` (the buffer's memory is about to be freed); after a reduction also
        forget that a gradient arrived."""
        if self.unsharded is not None:
            with metadata_access():  # the unsharded parameter may be fenced (resharded)
                if self.unsharded.grad is not None:
                    self.unsharded.grad = None
        if reduced:
            self.got_grad = False

    # --------------------------------------------------------------- the sharded .grad
    def take_sharded_grad(self, new: DTensor) -> None:
        """Give the sharded parameter the reduced gradient ``new`` (a view of the buffer's
        sharded gradients, owned by reference), adding it to a ``.grad`` that is already
        there (accumulation across reductions, as FSDP2 does), then run the sharded
        parameter's post-accumulate-grad hooks (optimizer in backward, per parameter). A
        ``.grad`` that memory-first mode released is replaced, not added to."""
        existing = self.sharded.grad
        if existing is None or is_released(existing):
            self.sharded.grad = new
        else:
            if not isinstance(existing, DTensor) or existing.placements != new.placements:
                raise TypeError(f"parameter {self.name!r}: cannot accumulate the reduced "
                                f"gradient into a .grad of type {type(existing).__name__} "
                                "(expected the DTensor fsdp set, or one placed like it)")
            with torch.no_grad():
                existing._local_tensor.add_(new._local_tensor)
        hooks = getattr(self.sharded, "_post_accumulate_grad_hooks", None) or {}
        for hook in hooks.values():
            hook(self.sharded)
