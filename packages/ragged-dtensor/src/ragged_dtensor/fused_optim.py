"""Fused optimizer steps (``AdamW(fused=True)``, ``Adam``, ``SGD``, ``Adagrad``) on RaggedShard
parameters: the fused kernel runs on the local runs, with no communication.

A fused step is elementwise per parameter: parameter ``i``, its gradient and its state
tensors are combined element by element, and the step count, learning rate, ``grad_scale`` and
``found_inf`` are scalars. So when each list position's full-shape tensors share one layout,
the kernel on the local runs is exactly the one-device step on those elements (a zero-unit
rank steps empty runs). torch's own plan for these ops would gather a RaggedShard input and
lose the in-place writes, so RaggedShard calls take this route instead; other DTensors keep
torch's path.

A position whose full-shape tensors have different placements (a gradient left ``Partial`` or
``Replicate`` beside a RaggedShard parameter) or whose layout is pending a reduction raises a
``RuntimeError`` naming it, on every rank alike (the check reads placements only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ragged_dtensor.op_routing import Route, add_routes

aten = torch.ops.aten

FUSED_STEP_OPS: frozenset[Any] = frozenset(
    {
        aten._fused_adam_.default,
        aten._fused_adam_.tensor_lr,
        aten._fused_adamw_.default,
        aten._fused_adamw_.tensor_lr,
        aten._fused_sgd_.default,
        aten._fused_sgd_.tensor_lr,
        aten._fused_adagrad_.default,
        aten._fused_adagrad_.tensor_lr,
    }
)


def _local(t: object) -> object:
    return t._local_tensor if isinstance(t, DTensor) else t


def _check_position(op_call: torch._ops.OpOverload, i: int, tensors: Sequence[object]) -> None:
    """The full-shape DTensors at list position ``i`` share a layout with no pending Partial,
    and the others (step counts) are plain or replicated scalars."""
    param = tensors[0]
    if not isinstance(param, DTensor):
        return
    for t in tensors[1:]:
        if not isinstance(t, DTensor):
            continue
        if t.shape == param.shape and t.placements == param.placements:
            continue
        if t.numel() == 1 and all(p.is_replicate() for p in t.placements):
            continue
        raise RuntimeError(
            f"{op_call}: tensor {i} of the parameter list has placements {param.placements} "
            f"but another of its per-parameter tensors has {t.placements} (shape "
            f"{tuple(t.shape)}); a fused step needs one layout per parameter. Redistribute the "
            "gradient or state to the parameter's placements first."
        )
    if any(p.is_partial() for p in param.placements):
        raise RuntimeError(
            f"{op_call}: parameter {i} is pending a reduction ({param.placements}); "
            "redistribute its Partial mesh dims first."
        )


def fused_step_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    """Run a fused optimizer step on the local runs of its DTensor arguments."""
    lists = [a for a in args if isinstance(a, (list, tuple))]
    for i in range(len(lists[0])):
        _check_position(op_call, i, [lst[i] for lst in lists if lst])
    local_args = tuple([_local(t) for t in a] if isinstance(a, (list, tuple)) else _local(a)
                       for a in args)
    op_call(*local_args, **{k: _local(v) for k, v in kwargs.items()})


ROUTES = {op: Route(fused_step_handler) for op in FUSED_STEP_OPS}


def install() -> None:
    """Route the fused optimizer steps of RaggedShard parameters here (idempotent)."""
    add_routes(ROUTES)
