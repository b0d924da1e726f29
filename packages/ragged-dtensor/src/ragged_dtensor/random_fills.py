"""Random ops on RaggedShard DTensors: each rank keeps its run of the one-device draw.

Running a random op on the local runs would draw the same numbers on every rank (each rank's
generator has the same state after a common seed), so a model initialised after sharding would
repeat blocks. Instead every rank runs the op on a full-shape tensor with the generator it was
given (or the default one of the device), exactly as one device would, and keeps its own flat
run of the result. The generator therefore advances as on one device, so sharded init equals
init-then-shard bit for bit, and so do all later draws.

Cost: every rank draws the whole tensor, with no communication. Time is that of the op on the
full tensor on one device; memory is one full-shape temporary per ragged argument and per
output while the op runs (freed afterwards). There is no chunking, because the stream a
chunked draw consumes is not the one-device stream for every op (CPU ``normal_`` transforms
blocks of 16 values, with a special tail). On the meta device nothing is drawn.

Fills whose values do not depend on the tensor's contents (``uniform_``, ``normal_``,
``random_``, ``rand_like``, ...) start from an empty full tensor; the ops that read values
(``bernoulli`` with probabilities from the tensor, ``native_dropout``, ``bernoulli_(p_tensor)``)
get the local run placed at its offset in a zero-filled full tensor, which is exact because
they draw one value per element regardless of the contents.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten, tree_unflatten

from ragged_dtensor.op_routing import Route, add_routes
from ragged_dtensor import composed
from ragged_dtensor.placement import find_ragged, is_ragged

aten = torch.ops.aten

#: random ops whose result does not depend on the values of their tensor inputs
VALUE_FREE_OPS: frozenset[Any] = frozenset(
    {
        aten.uniform_.default,
        aten.normal_.default,
        aten.random_.default,
        getattr(aten.random_, "from"),
        aten.random_.to,
        aten.exponential_.default,
        aten.geometric_.default,
        aten.cauchy_.default,
        aten.log_normal_.default,
        aten.bernoulli_.float,
        aten.rand_like.default,
        aten.randn_like.default,
        aten.randint_like.default,
        aten.randint_like.low_dtype,
    }
)

#: random ops that read their input's values (probabilities, the tensor dropped out)
VALUE_READING_OPS: frozenset[Any] = frozenset(
    {
        aten.bernoulli_.Tensor,
        aten.bernoulli.default,
        aten.bernoulli.p,
        aten.native_dropout.default,
    }
)


def local_flat_range(x: DTensor | DTensorSpec) -> tuple[int, int]:
    """This rank's flat element range ``[start, end)`` of a RaggedShard DTensor (or spec)."""
    found = find_ragged(x.placements)
    assert found is not None
    mesh_dim, placement = found
    mesh = x.device_mesh if isinstance(x, DTensor) else x.mesh
    composed.refuse(x.placements, "random ops (initialise parameters before fully_shard)")
    return placement.flat_range(tuple(x.shape), mesh.get_local_rank(mesh_dim))


def _check_args(op_call: torch._ops.OpOverload, dtensors: list[DTensor]) -> DTensor:
    """The ragged DTensor the op is drawn for; every other DTensor must be the same layout or
    fully replicated (a probability tensor, say). Raises on every rank alike otherwise."""
    target = next(d for d in dtensors if is_ragged(d))
    for d in dtensors:
        same = d.placements == target.placements and d.shape == target.shape
        if not same and not all(p.is_replicate() for p in d.placements):
            raise RuntimeError(
                f"{op_call} on a RaggedShard DTensor ({target.placements}) with another "
                f"DTensor argument of placements {d.placements} and shape {tuple(d.shape)}: "
                "redistribute it to the same RaggedShard (or Replicate) first."
            )
    if any(p.is_partial() for p in target.placements):
        raise RuntimeError(
            f"{op_call} on a RaggedShard DTensor pending a reduction ({target.placements}): "
            "redistribute the Partial mesh dims first."
        )
    return target


def random_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """A random op on RaggedShard DTensors, drawn on the full shape as one device would.

    Returns what the op returns: the mutated DTensor for in-place fills, new RaggedShard
    DTensors of the same layout for out-of-place ops.
    """
    leaves, treespec = tree_flatten((args, kwargs))
    target = _check_args(op_call, [leaf for leaf in leaves if isinstance(leaf, DTensor)])
    start, end = local_flat_range(target)
    device = target._local_tensor.device

    def full_of(d: DTensor) -> torch.Tensor:
        if op_call in VALUE_FREE_OPS:
            return torch.empty(tuple(d.shape), dtype=d.dtype, device=device)
        full = torch.zeros(tuple(d.shape), dtype=d.dtype, device=device)
        full.view(-1)[start:end].copy_(d._local_tensor)
        return full

    fulls = {
        i: full_of(leaf) if leaf.placements == target.placements else leaf._local_tensor
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, DTensor)
    }
    new_args, new_kwargs = tree_unflatten([fulls.get(i, leaf) for i, leaf in enumerate(leaves)],
                                          treespec)
    out = op_call(*new_args, **new_kwargs)
    if op_call._schema.returns and op_call._schema.returns[0].alias_info is not None:
        # in place: the mutated argument is the first one
        target._local_tensor.copy_(new_args[0].view(-1)[start:end])
        return args[0]

    def wrap(full: torch.Tensor) -> DTensor:
        meta = TensorMeta(full.shape, full.stride(), full.dtype)
        spec = DTensorSpec(target.device_mesh, target.placements, tensor_meta=meta)
        local = full.reshape(-1)[start:end].clone()
        return DTensor(local, spec, requires_grad=False)

    if isinstance(out, tuple):
        return tuple(wrap(o) for o in out)
    return wrap(out)


ROUTES = {op: Route(random_handler) for op in VALUE_FREE_OPS | VALUE_READING_OPS}


def install() -> None:
    """Route the random ops of RaggedShard DTensors to :func:`random_handler` (idempotent)."""
    add_routes(ROUTES)
