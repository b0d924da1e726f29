"""Views of RaggedShard DTensors: reshapes stay local aliases, every other view is refused.

A RaggedShard local tensor is one contiguous run of the row-major flattened tensor. Reshaping
the global tensor (``view``, ``reshape``, ``flatten``, ``view_as``, ``_unsafe_view``) keeps the
flat order, so each rank's run is the same run of the new shape: the output is a RaggedShard
of the new shape with the same per-rank element counts, and its local tensor is an alias of
the input's. No communication happens and an in-place op on the view writes into the
original, as it does on one device.

Any other aliasing op (``t``, ``transpose``, ``select``, ``slice``, indexing views,
``as_strided``, ``expand``, ``unsqueeze``, ``view(dtype)``, ...) would select elements that are
not this rank's run. DTensor's only general answer is to gather a copy, on which in-place
writes are silently lost, so :func:`alias_error` refuses them with a message naming the op.
The check uses only global metadata, so every rank raises alike and none is left waiting.

Beside tensor-parallel ``Shard`` placements (:mod:`ragged_dtensor.composed`) the run is one of
the TP-local tensor, which a new global shape would cut elsewhere: a reshape to the same
shape is an alias, any other raises ``NotImplementedError`` on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_dtensor import composed
from ragged_dtensor.op_routing import Route, add_routes, ragged_at
from ragged_dtensor.placement import RaggedShard, find_ragged
from ragged_dtensor.reductions import dispatch_default

aten = torch.ops.aten

#: reshapes that keep the row-major flat order (``flatten``/``view_as``/``reshape`` of a
#: contiguous tensor decompose into ``view``/``_unsafe_view`` before DTensor sees them)
RESHAPE_OPS: frozenset[Any] = frozenset(
    {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
)


def is_aliasing(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` returns a view of an input (a return aliased without being written)."""
    return any(
        ret.alias_info is not None and not ret.alias_info.is_write for ret in op._schema.returns
    )


def alias_error(op: torch._ops.OpOverload, placements: Sequence[object]) -> ValueError:
    """The error for a view op other than a reshape on a RaggedShard DTensor."""
    return ValueError(
        f"{op} is a view op, and a view of a RaggedShard DTensor ({tuple(placements)}) other "
        "than a reshape (view/reshape/flatten/view_as) cannot alias the local run: the result "
        "would be a gathered copy on which in-place writes are lost. Call .full_tensor() to "
        "read it, or .redistribute() to another placement first."
    )


def reshape_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """``view``/``reshape``/``_unsafe_view`` of a RaggedShard DTensor as a local alias.

    A RaggedShard DTensor whose global stride is not contiguous takes DTensor's ordinary
    dispatch (other DTensors never reach this handler).
    """
    x, size = args[0], (args[1] if len(args) > 1 else kwargs["size"])
    found = find_ragged(x.placements) if isinstance(x, DTensor) else None
    if found is None or tuple(x.stride()) != tuple(make_contiguous_strides_for(x.shape)):
        return dispatch_default(op_call, args, kwargs)
    mesh_dim, placement = found
    spec: DTensorSpec = x._spec
    # the new shape as one device computes it (-1 inferred, bad sizes raise the same error)
    new_shape = torch.empty(x.shape, device="meta").view(size).shape  # type: ignore[arg-type]
    if len(new_shape) == 0:
        raise alias_error(op_call, x.placements)
    if composed.is_composed(x.placements):  # a new shape would move the TP cut: no alias
        if tuple(new_shape) == tuple(x.shape):
            return aten.alias.default(x)
        composed.refuse(x.placements, f"reshapes ({op_call})")
    counts = [placement.local_numel(x.shape, r) for r in range(placement.num_ranks)]
    placements = list(spec.placements)
    placements[mesh_dim] = RaggedShard.from_element_counts(new_shape, counts)
    meta = TensorMeta(new_shape, tuple(make_contiguous_strides_for(new_shape)), x.dtype)
    out = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta)
    local = x._local_tensor
    return DTensor._op_dispatcher.wrap(local.view(local.numel()), out)


def as_strided_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """``as_strided`` of a RaggedShard DTensor: its own size, stride and offset give an alias
    (as torch's handler does for every DTensor); anything else is refused on every rank with
    the view error, naming the op (the check uses global metadata only)."""
    x = args[0]
    size, stride = args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if (tuple(x.shape) == tuple(size) and tuple(x.stride()) == tuple(stride)
            and offset in (None, x.storage_offset())):
        return aten.alias.default(x)
    raise RuntimeError(str(alias_error(op_call, x.placements)))


ROUTES = {
    **{op: Route(reshape_handler) for op in RESHAPE_OPS},
    aten.as_strided.default: Route(as_strided_handler, wants=ragged_at(0)),
}


def install() -> None:
    """Route the reshapes and ``as_strided`` of RaggedShard DTensors to these handlers
    (idempotent)."""
    add_routes(ROUTES)
