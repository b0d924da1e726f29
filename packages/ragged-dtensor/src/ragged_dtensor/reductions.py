"""Full reductions of RaggedShard DTensors: norms, max/min and mean as partial results.

A reduction over all elements of a RaggedShard tensor is the reduction of the per-rank
reductions of its 1-D local runs, so each rank computes its local value and the output is a
``Partial`` DTensor (``_NormPartial(p)`` for p-norms, ``Partial("max")`` for ``max`` and the
inf-norm, ``Partial("sum")`` for ``mean``). These ops take a :mod:`ragged_dtensor.op_routing`
route rather than a sharding plan for two reasons: reductions without an identity (``max``,
``min``, ``amax``, the ±inf-norms) raise on an empty local run, and a rank holding zero units
would then leave the others waiting in the reduction's collective, so the handler substitutes
the identity itself; and the right partial placement depends on ``ord``, a non-tensor argument
that DTensor's native cache does not key on for every op.

Anything else (a reduction over some dims, ``keepdim=True``, a negative finite ``ord``) is
passed on to DTensor's ordinary dispatch, which gathers a ragged input through
:mod:`ragged_dtensor.propagation`. The reductions without an identity also take the route for a
torch ``Shard`` DTensor whose dim is too short to give every rank a piece
(:func:`may_hold_empty_shard`): the empty ranks contribute the identity, where torch alone
would raise on them only. Every other non-ragged DTensor keeps torch's C++ fast path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

from ragged_dtensor import composed
from ragged_dtensor.identities import reduction_identity
from ragged_dtensor.op_routing import Route, add_routes, has_ragged_arg
from ragged_dtensor.placement import RaggedShard, is_ragged

aten = torch.ops.aten

_NOT_HANDLED = object()


def is_linear_partial(placement: Placement) -> bool:
    """A Partial whose pending reduction commutes with linear ops (a sum or an average)."""
    return type(placement) is Partial and placement.reduce_op in ("sum", "avg")


def settled(x: DTensor) -> DTensor:
    """``x`` with the Partial mesh dims beside its RaggedShard reduced to Replicate.

    A non-linear reduction of a pending gradient ``(Partial(), RaggedShard)`` needs the summed
    values; this is one all-reduce on the Partial mesh dims, with no gather of the ragged dim.
    """
    if not any(p.is_partial() for p in x.placements):
        return x
    placements = tuple(Replicate() if p.is_partial() else p for p in x.placements)
    return x.redistribute(x.device_mesh, placements)


def raise_if_empty(
    x: DTensor, op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    """Raise what one device raises for a reduction without identity of an empty tensor.

    The global shape is the same on every rank, so every rank raises alike.
    """
    if x.numel() == 0:
        op_call(torch.empty(x.shape, dtype=x.dtype), *args[1:], **kwargs)


def dispatch_default(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """Run ``op_call`` through DTensor's ordinary (Python) dispatch path.

    Used for the calls a custom handler does not take: propagation (with the ragged plans),
    redistribution of the inputs, the local op, and wrapping of the outputs.
    """
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    local_results = dispatcher._dispatch_get_local_results_slow_path(op_call, args, op_info)
    assert op_info.output_sharding is not None
    return dispatcher.wrap(local_results, op_info.output_sharding.output_spec)


def dispatch_with_identity(
    op_call: torch._ops.OpOverload,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    identity: Callable[[torch.dtype], float | int | bool],
) -> object:
    """DTensor's ordinary dispatch of a full reduction without an identity, except that a rank
    whose local tensor is empty (an uneven ``Shard``, for instance) returns ``identity(dtype)``
    as its partial result instead of raising while its peers wait in the collective."""
    x = args[0]
    if isinstance(x, DTensor) and x._local_tensor.numel() == 0:
        dispatcher = DTensor._op_dispatcher
        op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(op_info)
        sharding = op_info.output_sharding
        assert sharding is not None
        spec = sharding.output_spec
        if (not sharding.needs_redistribute and isinstance(spec, DTensorSpec)
                and spec.tensor_meta is not None and spec.tensor_meta.shape == torch.Size([])):
            dtype = spec.tensor_meta.dtype
            local = torch.full((), identity(dtype), dtype=dtype, device=x._local_tensor.device)
            return dispatcher.wrap(local, spec)
    return dispatch_default(op_call, args, kwargs)


def _partial_placements(
    x: DTensor, partial: Placement, linear: bool = False
) -> tuple[Placement, ...] | None:
    """Output placements of a full reduction: ``partial`` on the ragged mesh dim, Replicate
    kept elsewhere, and for a ``linear`` reduction (``mean``) a pending sum kept too; ``None``
    if another mesh dim has no local rule."""
    out: list[Placement] = []
    for p in x.placements:
        if isinstance(p, RaggedShard) or composed.is_tp_shard(p):  # disjoint pieces
            out.append(partial)
        elif isinstance(p, Replicate) or (linear and is_linear_partial(p)):
            out.append(p)
        else:
            return None
    return tuple(out)


def _wrap_scalar(local: torch.Tensor, x: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    meta = TensorMeta(shape=torch.Size([]), stride=(), dtype=local.dtype)
    spec = DTensorSpec(x.device_mesh, placements, tensor_meta=meta)
    return DTensor._op_dispatcher.wrap(local, spec)  # type: ignore[return-value]


def _norm_partial(ord: float) -> Placement | None:
    if ord == math.inf:
        return Partial("max")
    if ord == -math.inf:
        return Partial("min")
    if ord == 0:
        return Partial("sum")
    if ord > 0:
        return _NormPartial(ord)
    return None


def _inf_norm_identity(ord: float) -> float:
    """The partial inf-norm (``-inf``-norm) of an empty run: ``0`` (``inf``), not the ``-inf``
    of :func:`~ragged_dtensor.identities.reduction_identity`, because a norm is never negative
    and a pending partial norm may still pass through ``abs`` (``clip_grad_norm_`` takes the
    norm of the stacked per-tensor norms) before its max is reduced."""
    return 0.0 if ord > 0 else math.inf


def _local_vector_norm(local: torch.Tensor, ord: float, dtype: torch.dtype | None) -> torch.Tensor:
    """``vector_norm`` of a local run; the ±inf-norms of an empty run give their identity."""
    if local.numel() == 0 and math.isinf(ord):
        out_dtype = dtype or local.abs().dtype
        return torch.full((), _inf_norm_identity(ord), dtype=out_dtype, device=local.device)
    return torch.linalg.vector_norm(local, ord, dtype=dtype)


def _vector_norm(x: DTensor, ord: float, dim: object, keepdim: bool, dtype: torch.dtype | None
                 ) -> object:
    if dim not in (None, [], ()) or keepdim:
        return _NOT_HANDLED
    partial = _norm_partial(float(ord))
    x = settled(x)
    placements = None if partial is None else _partial_placements(x, partial)
    if placements is None:
        return _NOT_HANDLED
    return _wrap_scalar(_local_vector_norm(x._local_tensor, float(ord), dtype), x, placements)


def vector_norm_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """``aten.linalg_vector_norm.default`` over all elements of a RaggedShard DTensor."""
    x, *rest = args
    if is_ragged(x):
        names = ("ord", "dim", "keepdim")
        params = {"ord": 2, "dim": None, "keepdim": False, **dict(zip(names, rest)), **kwargs}
        if math.isinf(float(params["ord"])):
            raise_if_empty(x, op_call, args, kwargs)
        out = _vector_norm(x, params["ord"], params["dim"], params["keepdim"],
                           params.get("dtype"))
        if out is not _NOT_HANDLED:
            return out
    ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    if math.isinf(ord):
        return dispatch_with_identity(op_call, args, kwargs, lambda _: _inf_norm_identity(ord))
    return dispatch_default(op_call, args, kwargs)


def _local_extreme(local: torch.Tensor, largest: bool) -> torch.Tensor:
    if local.numel() == 0:
        identity = reduction_identity("max" if largest else "min", local.dtype)
        return torch.full((), identity, dtype=local.dtype, device=local.device)
    return local.max() if largest else local.min()


def extreme_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """``max``/``min`` (and ``amax``/``amin`` over all dims) of a RaggedShard DTensor."""
    x = args[0]
    if is_ragged(x):
        largest = op_call in (aten.max.default, aten.amax.default)
        full = True
        if op_call in (aten.amax.default, aten.amin.default):
            dim = list(args[1]) if len(args) > 1 else list(kwargs.get("dim", []))
            keepdim = bool(args[2]) if len(args) > 2 else bool(kwargs.get("keepdim", False))
            ndim = x.ndim
            full = not keepdim and (not dim or sorted(d % ndim for d in dim) == list(range(ndim)))
        if full:
            raise_if_empty(x, op_call, args, kwargs)
            x = settled(x)
        placements = _partial_placements(x, Partial("max" if largest else "min"))
        if full and placements is not None:
            return _wrap_scalar(_local_extreme(x._local_tensor, largest), x, placements)
    largest = op_call in (aten.max.default, aten.amax.default)
    reduce_op = "max" if largest else "min"
    return dispatch_with_identity(op_call, args, kwargs,
                                  lambda dtype: reduction_identity(reduce_op, dtype))


def mean_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """``mean`` of all elements: local sums divided by the global numel, summed as a Partial."""
    x = args[0]
    dtype = kwargs.get("dtype")
    if is_ragged(x) and (dtype or x.dtype).is_floating_point:
        placements = _partial_placements(x, Partial("sum"), linear=True)
        if placements is not None:
            local = x._local_tensor.sum(dtype=dtype) / x.numel()
            return _wrap_scalar(local, x, placements)
    return dispatch_default(op_call, args, kwargs)


def foreach_norm_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """``_foreach_norm`` over a list mixing RaggedShard and other DTensors.

    Ragged tensors take the vector-norm path above (zero-unit ranks included), and so does every
    tensor of an inf-norm list that holds an empty local tensor; the others go through one
    ``_foreach_norm`` call on DTensor's ordinary path.
    """
    tensors: Sequence[object] = args[0]  # type: ignore[assignment]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")

    def alone(t: object) -> bool:
        return is_ragged(t) or (
            math.isinf(float(ord)) and isinstance(t, DTensor) and t._local_tensor.numel() == 0
        )

    if not any(alone(t) for t in tensors):
        return dispatch_default(op_call, args, kwargs)
    others = [t for t in tensors if not alone(t)]
    other_norms = iter(aten._foreach_norm.Scalar(others, ord, dtype=dtype) if others else [])
    return [
        aten.linalg_vector_norm.default(t, ord, dtype=dtype) if alone(t) else next(other_norms)
        for t in tensors
    ]


def may_hold_empty_shard(x: object) -> bool:
    """Whether some rank's local tensor of the non-empty DTensor ``x`` is empty.

    A global fact (the specs and shapes every rank shares): torch's ``Shard(d)`` cuts dim ``d``
    into ``torch.chunk`` pieces, which leave trailing ranks empty when the dim is short (5 rows
    on 4 ranks give 2, 2, 1, 0). Nested shards of one dim are judged by their smallest piece;
    ``_StridedShard`` counts as possibly empty.
    """
    if not isinstance(x, DTensor) or x.numel() == 0:
        return False
    sizes = list(x.shape)
    for mesh_dim, p in enumerate(x.placements):
        if isinstance(p, _StridedShard):
            return True
        if isinstance(p, Shard):
            n, k = sizes[p.dim], x.device_mesh.size(mesh_dim)
            chunk = -(-n // k)
            if chunk * (k - 1) >= n:
                return True
            sizes[p.dim] = n - chunk * (k - 1)
    return False


def _wants_extreme(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """``max``/``min``/``amax``/``amin``: RaggedShard inputs, or a local shard that is empty."""
    return has_ragged_arg(args, kwargs) or may_hold_empty_shard(args[0])


def _norm_ord(args: tuple[object, ...], kwargs: dict[str, object]) -> float:
    return float(args[1] if len(args) > 1 else kwargs.get("ord", 2))


def _wants_vector_norm(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """RaggedShard inputs, or an inf-norm (no identity) of an input with an empty shard."""
    return has_ragged_arg(args, kwargs) or (
        math.isinf(_norm_ord(args, kwargs)) and may_hold_empty_shard(args[0])
    )


def _wants_foreach_norm(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    tensors: Sequence[object] = args[0]  # type: ignore[assignment]
    return has_ragged_arg(args, kwargs) or (
        math.isinf(_norm_ord(args, kwargs)) and any(may_hold_empty_shard(t) for t in tensors)
    )


ROUTES: dict[Any, Route] = {
    aten.linalg_vector_norm.default: Route(vector_norm_handler, _wants_vector_norm),
    aten.max.default: Route(extreme_handler, _wants_extreme),
    aten.min.default: Route(extreme_handler, _wants_extreme),
    aten.amax.default: Route(extreme_handler, _wants_extreme),
    aten.amin.default: Route(extreme_handler, _wants_extreme),
    aten.mean.default: Route(mean_handler),
    aten._foreach_norm.Scalar: Route(foreach_norm_handler, _wants_foreach_norm),
}


def install() -> None:
    """Route the full reductions of RaggedShard DTensors (and of DTensors with an empty local
    shard, for the reductions without identity) to these handlers (idempotent)."""
    add_routes(ROUTES)
