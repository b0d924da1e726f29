"""Route ops on RaggedShard DTensors to this package's handlers, and only those.

DTensor's C++ dispatcher (``dispatchDTensorOp``) first looks the op up in
``DTensor._op_dispatcher._custom_op_handlers``, a plain dict consulted on every call of every
DTensor; an entry there takes the op off the C++ fast path for *all* DTensors (tensor-parallel
``Shard`` code included). Without an entry it looks up its native sharding cache (keyed on the
op and the input specs) and only on a miss calls the Python
``_propagate_op_sharding_dispatch_slow_path``, which may return the op's *result* instead of an
``OutputSharding`` (torch uses that for decompositions); a result is never cached.

So this module keeps handlers out of the custom-op table and wraps the slow path instead: for
an op with a :class:`Route` whose ``wants`` predicate accepts the call (by default: some input
carries a RaggedShard), the route's handler computes the result; everything else goes on to
torch's slow path, whose ``OutputSharding`` the C++ cache then keeps, so plain DTensors pay
nothing after their first call. Because a spec that a route takes never gets a cache entry,
every later call with that spec reaches the route again.

torch's own custom-op handlers (``argmax``, convolution, ``as_strided``, the AMP unscale, ...)
run before any of this and treat an unknown placement as replicated, so for the ops this
package has an answer for, the table entry is replaced by :func:`ragged_first`'s function,
which gives RaggedShard calls to the route and every other call to torch's handler (the
route's predicate on top of a Python handler that runs anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpInfo

from ragged_dtensor.placement import is_ragged

Handler = Callable[[torch._ops.OpOverload, tuple[object, ...], dict[str, object]], object]


_NUMBERS = (int, float, bool)
_TENSOR = torch.Tensor


def has_ragged_arg(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """Whether any DTensor among ``args``/``kwargs`` (or in a list there) carries a RaggedShard.

    An aten op's tensors sit at most one list deep, so two loops do what a pytree flatten
    would, several times faster: this check runs in front of torch's own handlers on every
    call of theirs. A list of numbers (sizes, strides, scalars: aten never mixes them with
    tensors in one list) costs one check; a tensor list, optional entries included
    (``Tensor?[]``, e.g. ``[None, index]``), is scanned.
    """
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, DTensor):
            if is_ragged(arg._spec):
                return True
        elif (type(arg) is list or type(arg) is tuple) and arg and type(arg[0]) not in _NUMBERS:
            for item in arg:
                if isinstance(item, DTensor) and is_ragged(item._spec):
                    return True
    return False


def ragged_at(*positions: int) -> Callable[[tuple[object, ...], dict[str, object]], bool]:
    """A ``wants`` predicate for an op whose tensor inputs sit at ``positions`` of its
    arguments (``as_strided``'s ``self``; a convolution's input, weight and bias; the AMP
    unscale's gradient list, found_inf and inv_scale): it looks there only (into a tensor list
    too), plus any keyword argument, instead of scanning every argument as
    :func:`has_ragged_arg` does in front of torch's handler on every call."""

    def wants(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
        # a plain tensor (the AMP unscale's found_inf) is told apart by its type first: an
        # isinstance against DTensor costs a few times more for it
        count = len(args)
        for i in positions:
            if i < count:
                x = args[i]
                kind = type(x)
                if kind is list or kind is tuple:
                    for item in x:
                        if (type(item) is not _TENSOR and isinstance(item, DTensor)
                                and is_ragged(item._spec)):
                            return True
                elif kind is not _TENSOR and isinstance(x, DTensor) and is_ragged(x._spec):
                    return True
        return bool(kwargs) and has_ragged_arg((), kwargs)

    return wants


@dataclass(frozen=True)
class Route:
    """A handler for one op and the calls it takes.

    Attributes:
        handler: computes the op's result from the DTensor arguments.
        wants: ``wants(args, kwargs)`` says whether the handler takes this call; it may only
            depend on facts every rank shares (specs, shapes, non-tensor arguments), so that
            every rank takes the same path.
    """

    handler: Handler
    wants: Callable[[tuple[object, ...], dict[str, object]], bool] = has_ragged_arg


#: op -> route; filled by the modules that own the handlers (reductions, views, ...)
ROUTES: dict[Any, Route] = {}


def add_routes(routes: dict[Any, Route]) -> None:
    """Register ``routes`` (idempotent for the same route).

    Raises:
        RuntimeError: if another route is already registered for one of the ops.
    """
    for op, route in routes.items():
        current = ROUTES.get(op)
        if current is not None and current != route:
            raise RuntimeError(f"a RaggedShard route for {op} exists already: {current}")
        ROUTES[op] = route


class RaggedSlowPath:
    """Wraps the dispatcher's ``_propagate_op_sharding_dispatch_slow_path`` with :data:`ROUTES`."""

    def __init__(self, original: Callable[..., object]) -> None:
        self.original = original

    def __call__(self, op_call: torch._ops.OpOverload, args: tuple[object, ...],
                 kwargs: dict[str, object], op_info: OpInfo, try_cache: bool) -> object:
        route = ROUTES.get(op_call)
        if route is not None and route.wants(args, kwargs):
            return route.handler(op_call, args, kwargs)
        return self.original(op_call, args, kwargs, op_info, try_cache)


def ragged_slow_path(original: Callable[..., object]) -> RaggedSlowPath:
    """The :mod:`ragged_dtensor.torch_patches` factory of the dispatcher's slow path."""
    return RaggedSlowPath(original)


def ragged_first(torch_handler: Handler, op: torch._ops.OpOverload) -> Handler:
    """The :mod:`ragged_dtensor.torch_patches` factory of the custom-op table entry of torch's
    for ``op``, which has a route: calls on RaggedShard inputs take the route, others torch's
    handler.

    The entry is a plain function with the route bound when it is made (the routes are
    registered before :func:`ragged_dtensor.install` replaces the entries): every call of
    torch's handler then pays the route's ``wants`` predicate and one Python call, and no
    lookup. It carries ``route`` and ``torch_handler`` for inspection.

    Raises:
        KeyError: when ``op`` has no route.
    """
    route = ROUTES[op]
    wants, handler = route.wants, route.handler

    def entry(op_call: torch._ops.OpOverload, args: tuple[object, ...],
              kwargs: dict[str, object]) -> object:
        if wants(args, kwargs):
            return handler(op_call, args, kwargs)
        return torch_handler(op_call, args, kwargs)

    entry.route = route  # type: ignore[attr-defined]
    entry.torch_handler = torch_handler  # type: ignore[attr-defined]
    return entry
