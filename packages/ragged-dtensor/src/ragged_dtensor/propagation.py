"""Sharding propagation for ops on RaggedShard DTensors.

DTensor's C++ dispatcher asks the Python ``ShardingPropagator`` for an ``OutputSharding`` on
every cache miss and, when no input needs redistributing, runs the op on the local tensors and
wraps the result itself. torch's own strategies know nothing about ``RaggedShard``: left alone
they plan a gather to ``Replicate`` for every op, and an in-place op then silently rewrites a
parameter's spec to ``Replicate``. This module wraps the propagator so that an op touching a
RaggedShard input gets one of three plans:

* **local** (elementwise ops, their ``_foreach_*`` forms, ``*_like`` factories, ``copy_``,
  ``fill_``, ``zero_``, ``clone``, ``detach``): every input of the op's full shape is brought to
  the placement of the first ragged input (the mutated one for in-place ops), scalar-like
  inputs to ``Replicate``; the op runs on the 1-D local runs with no communication when the
  inputs already agree, and the output keeps the ragged placement. On the pending-gradient
  layout ``(Partial(), RaggedShard)`` linear ops keep the Partial; any other op has its
  Partial mesh dims reduced first (an all-reduce on those dims only);
* **partial** (``sum`` of all elements): the local sums become a ``Partial("sum")`` output;
  norms, ``max``/``min`` and ``mean`` are handled in :mod:`ragged_dtensor.reductions`;
* **gather** (anything else that does not alias its input: dim-wise reductions,
  broadcasting against a non-scalar, matmul): ragged inputs are redistributed to
  ``Replicate`` and torch's own strategy runs on the full tensors. It is correct for reading
  but moves the whole tensor, and it cannot write back, so a mutating op that would need it
  raises instead, and so does every view op (a view would be a gathered copy): reshapes are
  local aliases (:mod:`ragged_dtensor.views`), the others are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._sharding_prop import LocalLRUCache, ShardingPropagator
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate
from torch.utils._pytree import tree_flatten, tree_unflatten

from ragged_dtensor import composed, fused_optim, random_fills, reductions, torch_handlers, views
from ragged_dtensor.placement import RaggedShard, is_ragged

aten = torch.ops.aten

Propagate = Callable[[OpSchema], OutputSharding]

#: Elementwise ops that torch does not tag ``pointwise`` but that act element by element on
#: their full-shape inputs (or create a tensor shaped like one).
LIKE_OPS: frozenset[Any] = frozenset(
    {
        aten.copy_.default,
        aten.zero_.default,
        aten.fill_.Scalar,
        aten.fill_.Tensor,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.empty_like.default,
        aten.full_like.default,
        aten.detach.default,
        aten.alias.default,
        aten._to_copy.default,
        aten.clone.default,
    }
)

#: Full reductions planned here: the local result over the 1-D run is a partial result.
PARTIAL_REDUCTIONS: dict[Any, str] = {aten.sum.default: "sum"}

_FOREACH_PREFIX = "aten::_foreach_"


def replicated_spec(spec: DTensorSpec) -> DTensorSpec:
    """``spec`` with its ``RaggedShard`` replaced by ``Replicate()`` (the gather target)."""
    placements = tuple(Replicate() if isinstance(p, RaggedShard) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _is_local_layout(spec: DTensorSpec) -> bool:
    """One RaggedShard, every other mesh dim Replicate or Partial: the layouts whose local runs
    line up element by element across tensors of the same placements (HSDP parameters are
    ``(Replicate(), RaggedShard)``, their pending gradients ``(Partial(), RaggedShard)``)."""
    kinds = [isinstance(p, RaggedShard) for p in spec.placements]
    return sum(kinds) == 1 and all(
        ragged or p.is_replicate() or p.is_partial() or composed.is_tp_shard(p)
        for ragged, p in zip(kinds, spec.placements)
    )


def _reduced(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """``placements`` with every Partial mesh dim reduced to Replicate (the ragged dim kept)."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _base_name(op: torch._ops.OpOverload) -> str:
    """``aten::_foreach_mul_`` -> ``mul``: the op's name without namespace, foreach or ``_``."""
    name = op._schema.name.split("::")[-1]
    if name.startswith("_foreach_"):
        name = name[len("_foreach_"):]
    return name[:-1] if name.endswith("_") else name


#: ops linear in their full-shape inputs alone (no scalar operand that is not scaled too)
_LINEAR_UNARY = frozenset({"neg", "zero", "clone", "detach", "alias", "zeros_like", "copy",
                           "_to_copy"})


def _packet_is_elementwise(name: str) -> bool:
    """Whether some overload of ``aten.<name>`` is elementwise."""
    packet = getattr(aten, name, None)
    if packet is None:
        return False
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if torch.Tag.pointwise in op.tags or op in LIKE_OPS:
            return True
    return False


def is_elementwise(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` acts element by element.

    torch tags most elementwise ops ``pointwise`` but not every in-place variant (``abs_``)
    nor the ``_foreach_*`` list forms, so those are judged by their functional per-tensor op.
    A wrongly included op is still caught by the planner's output-shape check.
    """
    if torch.Tag.pointwise in op.tags or op in LIKE_OPS:
        return True
    name = op._schema.name.split("::")[-1]
    if name.startswith("_foreach_"):
        name = name[len("_foreach_"):]
    return _packet_is_elementwise(name) or (
        name.endswith("_") and _packet_is_elementwise(name[:-1])
    )


def is_foreach(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` is a ``_foreach_*`` op (its tensor lists are zipped element by element)."""
    return op._schema.name.startswith(_FOREACH_PREFIX)


@dataclass(frozen=True)
class _Leaf:
    """One DTensorSpec leaf of an op's flattened positional args (or a kwarg)."""

    index: int  # position among the flattened positional leaves; negative for kwargs
    spec: DTensorSpec
    mutated: bool


def _mutated_arg_names(op: torch._ops.OpOverload) -> set[str]:
    return {
        arg.name
        for arg in op._schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    }


def _leaf_groups(op_schema: OpSchema) -> tuple[list[object], Any, list[list[_Leaf]], list[_Leaf]]:
    """Flatten the args and group their DTensorSpec leaves by the element they act on.

    A plain op has one group. A ``_foreach_*`` op has one group per list position (the i-th
    tensor of every list); tensors outside lists (e.g. a scalar tensor) join every group.
    Returns ``(leaves, treespec, groups, kwarg_leaves)``.
    """
    op = op_schema.op
    mutated_names = _mutated_arg_names(op)
    arg_names = [a.name for a in op._schema.arguments if not a.kwarg_only]
    leaves, treespec = tree_flatten(list(op_schema.args_schema))
    groups: list[list[_Leaf]] = []
    shared: list[_Leaf] = []
    cursor = 0
    for position, arg in enumerate(op_schema.args_schema):
        mutated = position < len(arg_names) and arg_names[position] in mutated_names
        count = len(tree_flatten(arg)[0])
        if isinstance(arg, (list, tuple)) and is_foreach(op):
            for i in range(count):
                item = leaves[cursor + i]
                if isinstance(item, DTensorSpec):
                    while len(groups) <= i:
                        groups.append([])
                    groups[i].append(_Leaf(cursor + i, item, mutated))
        else:
            for i in range(count):
                item = leaves[cursor + i]
                if isinstance(item, DTensorSpec):
                    shared.append(_Leaf(cursor + i, item, mutated))
        cursor += count
    kwarg_leaves = [
        _Leaf(-1 - k, value, name in mutated_names)
        for k, (name, value) in enumerate(op_schema.kwargs_schema.items())
        if isinstance(value, DTensorSpec)
    ]
    if not groups:
        return leaves, treespec, [shared + kwarg_leaves], []
    return leaves, treespec, [g + shared for g in groups], kwarg_leaves


def _is_scalar_like(spec: DTensorSpec) -> bool:
    """A one-element tensor of at most one dim broadcasts against a 1-D local run unchanged."""
    shape = spec.shape
    return len(shape) <= 1 and spec.tensor_meta is not None and spec.tensor_meta.shape.numel() == 1


def _all_replicate(spec: DTensorSpec) -> DTensorSpec:
    placements = tuple(Replicate() for _ in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _with_placements(spec: DTensorSpec, placements: tuple[Placement, ...]) -> DTensorSpec:
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _keeps_partial(op: torch._ops.OpOverload, group: Sequence[_Leaf], target: DTensorSpec) -> bool:
    """Whether an elementwise group can run on pending (Partial-sum) runs without reducing them.

    True for linear ops: scaling by a scalar (``mul``, ``div`` of the pending tensor), ``neg``,
    ``add``/``sub`` of two tensors pending the same reduction, ``zero_``, ``copy_`` of a like
    tensor, ``clone``. Adding a scalar, multiplying two pending tensors, ``sqrt`` and the like
    are not (each replica would add the scalar once), so they reduce the Partial dims first.
    """
    if not all(reductions.is_linear_partial(p) for p in target.placements if p.is_partial()):
        return False
    full = [leaf for leaf in group if leaf.spec.shape == target.shape]
    scalars = [leaf for leaf in group if leaf.spec.shape != target.shape]
    if any(leaf.spec.placements != target.placements for leaf in full):
        return False
    if any(not all(p.is_replicate() for p in leaf.spec.placements) for leaf in scalars):
        return False
    base = _base_name(op)
    if base == "mul":
        return len(full) == 1
    if base == "div":
        return len(full) == 1 and group[0] is full[0]
    if base in ("add", "sub"):
        return len(full) == 2 and not scalars
    return base in _LINEAR_UNARY and not scalars


def _plan_local_group(
    op: torch._ops.OpOverload, group: Sequence[_Leaf]
) -> tuple[dict[int, DTensorSpec], tuple[Placement, ...]] | None:
    """Desired input specs and the output placements for running one elementwise group on the
    local runs, or ``None``.

    The target is the first mutated input, else the first ragged one; full-shape inputs move
    to the output placements, scalar-like ones to Replicate. The output placements are the
    target's, except that a target pending a reduction (Partial mesh dims) keeps it only for
    linear ops and is reduced on those dims alone (no gather of the ragged dim) for any other
    op. ``None`` when any input cannot (a non-scalar broadcast, a mutated input not already on
    the output placements, another layout).
    """
    target = _group_target(group)
    if not is_ragged(target) or not _is_local_layout(target):
        return None
    placements = target.placements
    if any(p.is_partial() for p in placements) and not _keeps_partial(op, group, target):
        placements = _reduced(placements)
    desired: dict[int, DTensorSpec] = {}
    for leaf in group:
        spec = leaf.spec
        if spec.mesh != target.mesh:
            return None
        if spec.shape == target.shape:
            want = _with_placements(spec, placements)
        elif _is_scalar_like(spec):
            want = _all_replicate(spec)
        else:
            return None
        if leaf.mutated and want.placements != spec.placements:
            return None
        desired[leaf.index] = want
    return desired, placements


def _group_target(group: Sequence[_Leaf]) -> DTensorSpec:
    """The spec a group's outputs take: the first mutated input, else the first ragged one."""
    mutated = [leaf for leaf in group if leaf.mutated]
    ragged = [leaf for leaf in group if is_ragged(leaf.spec)]
    return (mutated or ragged)[0].spec


def _output_metas(out_meta: object) -> list[TensorMeta | None]:
    if out_meta is None:
        return []
    if isinstance(out_meta, TensorMeta):
        return [out_meta]
    return list(out_meta)  # type: ignore[arg-type]


def _ragged_output(target: DTensorSpec, placements: tuple[Placement, ...],
                   meta: TensorMeta | None) -> DTensorSpec | None:
    if meta is None:
        return None
    return DTensorSpec(target.mesh, placements, tensor_meta=meta)


def _shapes_match(meta: TensorMeta | None, target: DTensorSpec) -> bool:
    return meta is None or tuple(meta.shape) == tuple(target.shape)


class RaggedPropagator:
    """Wraps a ``ShardingPropagator``'s non-cached entry point with the RaggedShard plans."""

    def __init__(self, propagator: ShardingPropagator, original: Propagate) -> None:
        self.propagator = propagator
        self.original = original

    def __call__(self, op_schema: OpSchema) -> OutputSharding:
        leaves = tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0]
        if not any(is_ragged(leaf) for leaf in leaves):
            return self.original(op_schema)
        op = op_schema.op
        if op in PARTIAL_REDUCTIONS:
            planned = self._plan_partial(op_schema)
            if planned is not None:
                return planned
        if is_elementwise(op):
            planned = self._plan_elementwise(op_schema)
            if planned is not None:
                return planned
        return self._plan_gather(op_schema)

    # -- partial reductions -------------------------------------------------------------
    def _plan_partial(self, op_schema: OpSchema) -> OutputSharding | None:
        specs = [a for a in op_schema.args_schema if isinstance(a, DTensorSpec)]
        if len(specs) != 1 or not _is_local_layout(specs[0]):
            return None
        if not all(reductions.is_linear_partial(p) for p in specs[0].placements if p.is_partial()):
            return None
        reduce_op = PARTIAL_REDUCTIONS[op_schema.op]
        spec = specs[0]
        placements = tuple(
            Partial(reduce_op) if isinstance(p, RaggedShard) or composed.is_tp_shard(p) else p
            for p in spec.placements
        )
        meta = self.propagator._propagate_tensor_meta_non_cached(op_schema)
        if not isinstance(meta, TensorMeta):
            return None
        return OutputSharding(DTensorSpec(spec.mesh, placements, tensor_meta=meta))

    # -- elementwise ops ----------------------------------------------------------------
    def _plan_elementwise(self, op_schema: OpSchema) -> OutputSharding | None:
        leaves, treespec, groups, kwarg_leaves = _leaf_groups(op_schema)
        out_metas = _output_metas(self.propagator._propagate_tensor_meta_non_cached(op_schema))
        foreach = is_foreach(op_schema.op)
        desired: dict[int, DTensorSpec] = {}
        # one output per group for _foreach_* ops (none when in place), else the op's outputs
        outputs: list[DTensorSpec | None] = [None] * (len(groups) if foreach else len(out_metas))
        delegated: list[int] = []
        for i, group in enumerate(groups):
            if not any(is_ragged(leaf.spec) for leaf in group):
                if not foreach:
                    return None
                delegated.append(i)
                continue
            planned = _plan_local_group(op_schema.op, group)
            if planned is None:
                return None
            plan, placements = planned
            target = _group_target(group)
            slots = ([i] if out_metas else []) if foreach else list(range(len(out_metas)))
            if not all(_shapes_match(out_metas[j], target) for j in slots):
                return None
            for index, spec in plan.items():
                if desired.setdefault(index, spec).placements != spec.placements:
                    return None
            for j in slots:
                outputs[j] = _ragged_output(target, placements, out_metas[j])
        # keyword tensors (``out=``) are never redistributed by the dispatcher
        for leaf in kwarg_leaves:
            if leaf.index in desired and desired[leaf.index].placements != leaf.spec.placements:
                return None
        if delegated and not self._merge_delegated(
            op_schema, len(groups), delegated, desired, outputs
        ):
            return None
        return self._finish(op_schema, leaves, treespec, desired, outputs, out_metas)

    def _merge_delegated(
        self,
        op_schema: OpSchema,
        n: int,
        delegated: list[int],
        desired: dict[int, DTensorSpec],
        outputs: list[DTensorSpec | None],
    ) -> bool:
        """Plan the non-ragged elements of a mixed ``_foreach_*`` list with torch's strategy,
        updating ``desired`` and ``outputs``; ``False`` if the two plans disagree."""
        keep = set(delegated)

        def is_list(arg: object) -> bool:
            return isinstance(arg, (list, tuple)) and len(arg) == n

        sub_schema = OpSchema(
            op_schema.op,
            tuple(
                type(a)(x for i, x in enumerate(a) if i in keep) if is_list(a) else a
                for a in op_schema.args_schema
            ),
            op_schema.kwargs_schema,
            schema_info=op_schema.schema_info,
        )
        sub = self.original(sub_schema)
        sub_args = (sub.redistribute_schema if sub.needs_redistribute else sub_schema).args_schema
        # the full schema's flat leaf index of every leaf of the sub-schema
        positions: list[int] = []
        cursor = 0
        for arg in op_schema.args_schema:
            count = len(tree_flatten(arg)[0])
            if is_list(arg):
                positions.extend(cursor + i for i in sorted(keep))
            else:
                positions.extend(range(cursor, cursor + count))
            cursor += count
        for index, spec in zip(positions, tree_flatten(list(sub_args))[0]):
            if isinstance(spec, DTensorSpec):
                if index in desired and desired[index].placements != spec.placements:
                    return False
                desired[index] = spec
        if isinstance(sub.output_spec, (list, tuple)):
            for i, spec in zip(sorted(keep), sub.output_spec):
                outputs[i] = spec
        return True

    def _finish(
        self,
        op_schema: OpSchema,
        leaves: list[object],
        treespec: Any,
        desired: dict[int, DTensorSpec],
        outputs: list[DTensorSpec | None],
        out_metas: list[TensorMeta | None],
    ) -> OutputSharding:
        new_leaves = [desired.get(i, leaf) for i, leaf in enumerate(leaves)]
        needs_redistribute = any(
            isinstance(old, DTensorSpec) and old.placements != new.placements
            for old, new in zip(leaves, new_leaves)
        )
        redistribute_schema = None
        if needs_redistribute:
            redistribute_schema = OpSchema(
                op_schema.op,
                tuple(tree_unflatten(new_leaves, treespec)),
                op_schema.kwargs_schema,
                schema_info=op_schema.schema_info,
            )
        if not out_metas or all(m is None for m in out_metas):
            output_spec: object = None
        elif op_schema.return_type_tuple_tensor_like() or op_schema.return_type_list_tensor_like():
            output_spec = tuple(outputs)
        else:
            output_spec = outputs[0]
        return OutputSharding(
            output_spec,  # type: ignore[arg-type]
            redistribute_schema,
            needs_redistribute=needs_redistribute,
        )

    # -- everything else: gather ----------------------------------------------------------
    def _plan_gather(self, op_schema: OpSchema) -> OutputSharding:
        leaves, treespec, groups, kwarg_leaves = _leaf_groups(op_schema)
        if views.is_aliasing(op_schema.op):
            ragged = next(leaf for leaf in leaves if is_ragged(leaf))
            raise views.alias_error(op_schema.op, ragged.placements)
        for group in groups:
            for leaf in group:
                if leaf.mutated and is_ragged(leaf.spec):
                    raise ValueError(
                        f"{op_schema.op} would modify a RaggedShard DTensor "
                        f"({leaf.spec.placements}) through a gathered copy, so the write would "
                        "be lost; this op cannot run on RaggedShard inputs in place. "
                        "Redistribute explicitly (e.g. to Replicate) or use the out-of-place op."
                    )
        for leaf in kwarg_leaves:
            if is_ragged(leaf.spec):
                raise ValueError(
                    f"{op_schema.op}: a RaggedShard DTensor passed as a keyword argument "
                    f"({leaf.spec.placements}) cannot be gathered automatically; redistribute it "
                    "explicitly first."
                )
        shadow_leaves = [replicated_spec(x) if is_ragged(x) else x for x in leaves]
        shadow = OpSchema(
            op_schema.op,
            tuple(tree_unflatten(shadow_leaves, treespec)),
            op_schema.kwargs_schema,
            schema_info=op_schema.schema_info,
        )
        planned = self.original(shadow)
        return OutputSharding(
            planned.output_spec,
            planned.redistribute_schema if planned.needs_redistribute else shadow,
            needs_redistribute=True,
            use_val_from_redistribute_schema=planned.use_val_from_redistribute_schema,
        )


def register_routes() -> None:
    """Register the op routes of :mod:`ragged_dtensor.reductions`, :mod:`ragged_dtensor.views`,
    :mod:`ragged_dtensor.torch_handlers`, :mod:`ragged_dtensor.fused_optim` and
    :mod:`ragged_dtensor.random_fills` (idempotent; :func:`ragged_dtensor.install` calls it)."""
    for module in (reductions, views, torch_handlers, fused_optim, random_fills):
        module.install()


def patched_propagator(original: Propagate) -> RaggedPropagator:
    """The :mod:`ragged_dtensor.torch_patches` factory of the sharding propagator's
    ``propagate_op_sharding_non_cached`` (a bound method of DTensor's one propagator)."""
    return RaggedPropagator(original.__self__, original)  # type: ignore[attr-defined]


def patched_propagator_cache(original: LocalLRUCache) -> LocalLRUCache:
    """The :mod:`ragged_dtensor.torch_patches` factory of the cached ``propagate_op_sharding``:
    torch's LRU cache wraps the bound method it was built with, so a new cache wraps the
    :class:`RaggedPropagator` installed just before it."""
    wrapped = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached
    if not isinstance(wrapped, RaggedPropagator):
        raise RuntimeError("the ragged propagator must be installed before its cache")
    return LocalLRUCache(wrapped)
