"""RaggedShard answers for the ops torch's DTensor handles in its own custom-op table.

torch 2.13 registers Python handlers that run before any sharding propagation and treat every
placement that is not a ``Shard`` as replicated. On a RaggedShard input they give each rank a
different answer labelled ``Replicate`` (``argmax``), run a convolution on 1-D runs, or decide
"found inf" from the first gradient's placement alone. The ops here take a
:mod:`ragged_dtensor.op_routing` route for RaggedShard inputs (other DTensors keep torch's
handler):

* ``argmax`` / ``argmin`` over all elements: each rank's best value and its global flat index
  (``start`` of its run plus the local index) are all-gathered over the ragged mesh dim and
  every rank picks the first best, ties and NaN resolved as on one device; ranks holding zero
  units take no part in the choice. With ``dim=`` the input is gathered to ``Replicate`` and
  torch's handler runs on the full tensor. The result is a ``Replicate`` DTensor.
* ``convolution`` / ``convolution_backward``: gathered (DTensor's ordinary dispatch with the
  ragged inputs redistributed to ``Replicate``); the outputs are torch's full results.
* ``_amp_foreach_non_finite_check_and_unscale_`` (``GradScaler``): unscales every local run
  in place and then all-reduces ``found_inf`` (max) over every dim of the gradients' meshes,
  so one non-finite value anywhere makes every rank skip the step, as on one device.
* ``is_same_size`` (global shapes) and ``is_pinned`` (the local tensor's memory) are right for
  RaggedShard as torch has them; ``as_strided`` is in :mod:`ragged_dtensor.views`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Replicate

from ragged_dtensor.op_routing import Route, add_routes, ragged_at
from ragged_dtensor.peer_failure import collective_guard
from ragged_dtensor.placement import find_ragged
from ragged_dtensor.random_fills import local_flat_range
from ragged_dtensor.reductions import dispatch_default, raise_if_empty, settled

aten = torch.ops.aten


def _replicated(x: DTensor) -> DTensor:
    return x.redistribute(x.device_mesh, tuple(Replicate() for _ in x.placements))


def argminmax_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """``argmax`` / ``argmin`` of a RaggedShard DTensor, as one device computes it."""
    x: DTensor = args[0]  # type: ignore[assignment]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    x = settled(x)
    if dim is not None:
        return op_call(_replicated(x), dim, keepdim)
    raise_if_empty(x, op_call, args, kwargs)
    mesh_dim, _ = find_ragged(x.placements)  # type: ignore[misc]
    start, _ = local_flat_range(x)
    local = x._local_tensor
    largest = op_call == aten.argmax.default
    value = torch.zeros(1, dtype=local.dtype, device=local.device)
    where = torch.zeros(2, dtype=torch.int64, device=local.device)  # (holds elements, index)
    if local.numel():
        value[0] = local.max() if largest else local.min()
        where[0], where[1] = 1, op_call(local) + start
    else:
        # a dtype the op refuses (bool) must fail here as on the ranks holding elements
        op_call(torch.zeros(1, dtype=local.dtype, device=local.device))
    group = x.device_mesh.get_group(mesh_dim)
    world = dist.get_world_size(group)
    values = torch.empty(world, dtype=value.dtype, device=value.device)
    wheres = torch.empty(2 * world, dtype=where.dtype, device=where.device)
    with collective_guard(f"all_gather ({op_call})", group):
        dist.all_gather_single(values, value, group=group)
        dist.all_gather_single(wheres, where, group=group)
    wheres = wheres.view(world, 2)
    holders = wheres[:, 0].nonzero().view(-1)
    best = holders[op_call(values[holders])]
    shape = torch.Size([1] * x.ndim if keepdim else [])
    local_out = wheres[best, 1].reshape(shape).clone()
    meta = TensorMeta(shape, local_out.stride(), torch.int64)
    spec = DTensorSpec(x.device_mesh, tuple(Replicate() for _ in x.placements), tensor_meta=meta)
    return DTensor._op_dispatcher.wrap(local_out, spec)


def gather_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """DTensor's ordinary dispatch: RaggedShard inputs are gathered to ``Replicate`` first."""
    return dispatch_default(op_call, args, kwargs)


def amp_unscale_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    """``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`` with
    RaggedShard gradients: local unscale, then ``found_inf`` maxed over every mesh dim of the
    gradients' meshes (one small all-reduce per mesh dim)."""
    grads: Sequence[object] = args[0]  # type: ignore[assignment]
    found_inf, inv_scale = args[1], args[2]

    def local(t: object) -> object:
        return t._local_tensor if isinstance(t, DTensor) else t

    found_local: torch.Tensor = local(found_inf)  # type: ignore[assignment]
    op_call([local(g) for g in grads], found_local, local(inv_scale), **kwargs)
    meshes = []
    for g in grads:
        if isinstance(g, DTensor) and g.device_mesh not in meshes:
            meshes.append(g.device_mesh)
    for mesh in meshes:
        for mesh_dim in range(mesh.ndim):
            group = mesh.get_group(mesh_dim)
            with collective_guard("all_reduce (AMP found_inf)", group):
                dist.all_reduce(found_local, op=dist.ReduceOp.MAX, group=group)


# convolution(input, weight, bias, ...), convolution_backward(grad_output, input, weight, ...)
_CONVOLUTION_TENSORS = ragged_at(0, 1, 2)

ROUTES = {
    aten.argmax.default: Route(argminmax_handler),
    aten.argmin.default: Route(argminmax_handler),
    aten.convolution.default: Route(gather_handler, wants=_CONVOLUTION_TENSORS),
    aten.convolution_backward.default: Route(gather_handler, wants=_CONVOLUTION_TENSORS),
    aten._amp_foreach_non_finite_check_and_unscale_.default: Route(
        amp_unscale_handler, wants=ragged_at(0, 1, 2)),
}


def install() -> None:
    """Route these ops on RaggedShard inputs here (idempotent); :func:`ragged_dtensor.install`
    then wraps torch's own table entries."""
    add_routes(ROUTES)

