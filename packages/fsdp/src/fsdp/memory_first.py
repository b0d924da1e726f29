"""Memory-first training: the optimizer steps each group as soon as its gradients are reduced.

In an ordinary step every sharded gradient of the model exists at once, between the end of
backward and ``optimizer.zero_grad()``. When memory is what limits the model, that peak can be
cut to one group's sharded gradients: as each group's reduce-scatter lands (inside backward),
its parameters are stepped and their gradients dropped right away.

Any optimizer that skips parameters whose ``.grad`` is ``None`` works unchanged (every
``torch.optim`` optimizer and block-optim's Muon, Shampoo and AdamW8bit do): at the moment a
group finishes, only its parameters hold gradients, so ``optimizer.step()`` updates exactly
those, with the same per-parameter state as the ordinary step. The result equals
``backward(); step(); zero_grad()`` for optimizers whose update of one parameter does not read
another parameter's gradient (no global gradient norm, no cross-parameter statistics).

Gradient clipping by the global norm cannot be exact here: the norm needs every gradient
before the first step. So :func:`optimizer_in_backward` takes no clipping option, and the
stepped gradients are released in place (:func:`dbuffer.release_in_place`) rather than set to
``None``: a ``clip_grad_norm_`` or a second ``optimizer.step()`` after such a backward raises
``FreedBufferError`` naming this mode, where a ``None`` gradient would let it silently clip or
step nothing. ``zero_grad(set_to_none=True)`` still works, and the next reduction replaces a
released gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from dbuffer import is_released, release_in_place

from fsdp.param_group import FSDPParamGroup
from fsdp.state import get_state

__all__ = ["InBackwardHandle", "optimizer_in_backward"]


def optimizer_in_backward(module: nn.Module,
                          optimizer: torch.optim.Optimizer) -> InBackwardHandle:
    """Step ``optimizer`` on each group of ``module`` as soon as the group's gradients are
    reduced, and free them right away (memory-first mode).

    Call once after ``fully_shard`` and after building the optimizer; then train with
    ``loss.backward()`` alone (no ``optimizer.step()`` / ``zero_grad()``; a learning-rate
    scheduler is stepped as usual). With gradient accumulation
    (``set_requires_gradient_sync(False)`` on the non-final micro-batches) the step runs on
    the final micro-batch's reduction, as the ordinary step would.

    Args:
        module: the root module ``fully_shard`` was applied to (its sharded submodules are
            included).
        optimizer: an optimizer over (a superset of) the module's parameters that skips
            parameters without a gradient.

    Returns:
        A handle whose ``remove()`` returns to the ordinary step.

    Raises:
        TypeError: when ``module`` was not sharded by ``fully_shard`` or ``optimizer`` is not
            a ``torch.optim.Optimizer``.
        ValueError: when a group's parameters are not all in ``optimizer`` (stepping it
            would leave their gradients unused).
    """
    if get_state(module) is None:
        raise TypeError(f"optimizer_in_backward: {type(module).__name__} is not a module "
                        "fully_shard was applied to")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer_in_backward: optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    groups = _groups(module)
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    managed = {id(p.sharded) for group in groups for p in group.params}
    for group in groups:
        missing = [p.name for p in group.params if p.trainable and id(p.sharded) not in owned]
        if missing:
            raise ValueError(f"optimizer_in_backward: parameters {missing} of {group.label} are "
                             "not in the optimizer")
    if owned - managed:
        raise ValueError(f"optimizer_in_backward: the optimizer holds {len(owned - managed)} "
                         f"parameter(s) that no fully_shard group of {type(module).__name__} "
                         "manages; they would be stepped once per group")
    step = _step_group(optimizer, groups)
    for group in groups:
        group.after_reduce = step

    return InBackwardHandle(groups, step)


@dataclass
class InBackwardHandle:
    """What :func:`optimizer_in_backward` returns: ``remove()`` returns to the ordinary step."""

    groups: list[FSDPParamGroup]
    step: Callable[[FSDPParamGroup], None]

    def remove(self) -> None:
        """Stop stepping in backward (the next backward leaves the gradients in place)."""
        for group in self.groups:
            if group.after_reduce is self.step:
                group.after_reduce = None


def _groups(module: nn.Module) -> list[FSDPParamGroup]:
    seen: list[FSDPParamGroup] = []
    for m in module.modules():
        state = get_state(m)
        for group in state.groups if state is not None else ():
            if group not in seen:
                seen.append(group)
    return seen


_SPENT = ("this gradient was consumed inside backward by fsdp.optimizer_in_backward "
          "(memory-first mode): the optimizer already stepped on it and its memory is freed; "
          "clip_grad_norm_ and optimizer.step() cannot run after such a backward (use the "
          "ordinary step to clip by the global norm)")


def _step_group(optimizer: torch.optim.Optimizer,
                groups: list[FSDPParamGroup]) -> Callable[[FSDPParamGroup], None]:
    params = [p.sharded for g in groups for p in g.params]

    def step(group: FSDPParamGroup) -> None:
        # Other groups' released gradients sit out this step (the optimizer skips None).
        parked = [(p, p.grad) for p in params if is_released(p.grad)]
        for p, _ in parked:
            p.grad = None
        try:
            optimizer.step()
        finally:
            for p, grad in parked:
                p.grad = grad
        release_in_place([p.sharded.grad for p in group.params if p.sharded.grad is not None],
                         _SPENT)

    return step
