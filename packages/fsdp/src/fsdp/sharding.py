"""From a module's parameters to a planned, sharded group: collect, plan, allocate, register.

``fully_shard`` collects the parameters its modules own (not those of submodules already
sharded, nor ``ignored_params``), in registration order, with every ``(module, attribute)``
slot that registers each (tied weights), plans them with ``layout_planner.plan_buckets`` per
kind (trainable parameters of one dtype; frozen parameters of one dtype, which get a DBuffer
without gradient memory), allocates one DBuffer per bucket, copies each rank's run in once,
and registers a RaggedShard DTensor parameter over each run in place of the original (a
``Shard(d)`` one for a parameter ``shard_placement_fn`` cuts along ``d > 0``, planned alone,
dim-first: :mod:`fsdp.dim_shard`). A group
of meta-device parameters gets meta-device DBuffers (no memory), so its sharded parameters
stay on the meta device until ``to_empty``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from dbuffer import DBuffer
from layout_planner import Plan, TensorSpec, plan_buckets
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard

from fsdp.backward_split import backward_stages, cut_by_children
from fsdp.buffers import buffer_dtypes, make_buffer, sharded_parameter
from fsdp.dim_shard import (
    DimShard,
    DimShardManagedParam,
    TPDimShardManagedParam,
    check_even,
    checked_dim,
)
from fsdp.managed_param import ManagedParam
from fsdp.param_group import FSDPParamGroup
from fsdp.policies import UnitPolicy, resolve_unit
from fsdp.tensor_parallel import TPLayout, TPManagedParam, stored_tensor
from fsdp import dim_shard, tensor_parallel

# Marks set on parameters (tensors hash by identity but compare element-wise, so weak
# containers cannot hold them): the group label that took an original parameter, to name both
# groups in the error FSDP2 gives for a parameter shared across groups, and a flag on the
# sharded parameters we registered, to recognise fully_shard applied top-down.
_OWNER_ATTR = "_fsdp_owner_group"
_SHARDED_ATTR = "_fsdp_sharded"

_COLLECTIVE_ALIGN_BYTES = 16
# One more buffer is one more collective per pass; its latency is worth about this many bytes
# per rank on today's links (microseconds at tens of GB/s), so a bucket split must save more
# padding than that to be chosen.
_BUCKET_COST_BYTES_PER_RANK = 1 << 20


@dataclass
class Collected:
    """A parameter to shard: its name in the group and every slot registering it."""

    name: str
    param: nn.Parameter
    slots: list[tuple[nn.Module, str]]
    # The label of the group that already manages this parameter (shared across groups):
    # FSDP2 shards it again and raises at the root's first forward; so does fsdp.
    shared_with: str | None = None
    # Registered after the group's last child group (see ManagedModule).
    after_children: bool = False


class ManagedModule(NamedTuple):
    """A module whose parameters a new group takes, and where it sits among the group's
    children (modules that already have a ``fully_shard`` state)."""

    prefix: str
    module: nn.Module
    # Registered after the last child group, with at least one before it: used after the
    # children in forward, as a model's final norm and output head (:mod:`fsdp.backward_split`).
    after_children: bool


def managed_modules(modules: Iterable[nn.Module],
                    is_sharded: Callable[[nn.Module], bool]) -> list[ManagedModule]:
    """The modules whose parameters a new group takes: ``modules`` and their descendants,
    not descending into modules that already have a ``fully_shard`` state, in registration
    order."""
    modules = list(modules)
    visited: list[tuple[str, nn.Module, int]] = []  # with the children seen before it
    seen: set[int] = set()
    children = 0

    def visit(prefix: str, module: nn.Module, root: bool) -> None:
        nonlocal children
        if id(module) in seen:
            return
        if not root and is_sharded(module):
            children += 1
            return
        seen.add(id(module))
        visited.append((prefix, module, children))
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child, False)

    for i, module in enumerate(modules):
        visit(str(i) if len(modules) > 1 else "", module, True)
    return [ManagedModule(prefix, module, 0 < children == before)
            for prefix, module, before in visited]


def collect_params(modules: list[ManagedModule],
                   ignored: set[nn.Parameter]) -> list[Collected]:
    """Parameters of ``modules`` in registration order, tied ones once with all their slots.

    A parameter another group already manages is collected with ``shared_with`` set: the
    error comes at the root's first forward, where FSDP2 raises it (see
    :meth:`fsdp.state.FSDPState._check_no_shared_params`).

    Raises:
        ValueError: for a parameter already sharded (``fully_shard`` applied top-down) or one
            with no elements.
        NotImplementedError: for a non-contiguous parameter (as FSDP2).
    """
    by_param: dict[nn.Parameter, Collected] = {}
    for prefix, module, after_children in modules:
        for attr, param in module._parameters.items():
            if param is None or param in ignored:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if param in by_param:
                by_param[param].slots.append((module, attr))
                continue
            if getattr(param, _SHARDED_ATTR, False):
                raise ValueError(
                    f"fully_shard: parameter {name!r} is already sharded by fully_shard on an "
                    "enclosing module; apply fully_shard bottom-up (blocks first, then the root)")
            if param.dim() == 0:
                raise ValueError(f"fully_shard doesn't support scalar parameters. Change {name} "
                                 "to a 1D tensor with numel equal to 1.")
            if not param.is_contiguous():
                # FSDP2's error and words: the unsharded parameter is a contiguous view of
                # the buffer, so a memory format (channels_last) would be silently dropped.
                raise NotImplementedError(
                    f"FSDP does not support non-contiguous parameters yet: {name} "
                    f"param.shape={tuple(param.shape)} param.stride()={param.stride()}")
            if param.numel() == 0:
                raise ValueError(f"fully_shard: parameter {name!r} has no elements (shape "
                                 f"{tuple(param.shape)}); fsdp cannot shard it: exclude it "
                                 "with ignored_params")
            by_param[param] = Collected(name, param, [(module, attr)],
                                        shared_with=getattr(param, _OWNER_ATTR, None),
                                        after_children=after_children)
    return list(by_param.values())


def _kind(param: nn.Parameter) -> tuple[bool, torch.dtype]:
    return param.requires_grad, param.dtype


def _align(dtypes: Iterable[torch.dtype]) -> int:
    """Elements per 16 bytes in the narrowest dtype a buffer's collectives move."""
    return max(1, _COLLECTIVE_ALIGN_BYTES // min(d.itemsize for d in dtypes))


def resolve_units(collected: list[Collected], unit_policy: UnitPolicy | None,
                  shard_dims: Mapping[str, int], meshes: Mapping[str, DeviceMesh],
                  layouts: Mapping[str, TPLayout]
                  ) -> tuple[dict[str, int], dict[str, DimShard]]:
    """Every parameter's unit under the user's policies, and the parameters
    ``shard_placement_fn`` cuts along a dim ``d > 0`` over their mesh (``shard_dims`` and
    ``meshes``, from :func:`fsdp.dim_shard.shard_dims`), whose unit is their whole chunk
    (``unit_policy`` does not apply to them).

    Raises:
        AssertionError: for a ``Shard`` dim the parameter lacks (FSDP2's error).
        NotImplementedError: for uneven ``Shard(d > 0)`` chunks (FSDP2's error), or
            ``Shard(d > 0)`` along a dim tensor parallelism already cuts (FSDP2's
            ``_StridedShard`` case).
        ValueError: for a bad unit.
    """
    units: dict[str, int] = {}
    dims: dict[str, DimShard] = {}
    for c in collected:
        tensor = stored_tensor(c.param)
        dim = checked_dim(c.param, shard_dims[c.name])
        if dim == 0:
            units[c.name] = resolve_unit(c.name, tensor, unit_policy)
            continue
        layout = layouts.get(c.name)
        if layout is not None and any(isinstance(p, Shard) and p.dim == dim
                                      for p in layout.tp_placements):
            raise NotImplementedError(
                f"shard_placement_fn returned Shard({dim}) for parameter {c.name!r}, whose dim "
                f"{dim} tensor parallelism already cuts ({layout.tp_placements}); fsdp cuts a "
                "tensor-parallel parameter along dim 0 or a dim TP leaves whole")
        shard_size = meshes[c.name].size(meshes[c.name].ndim - 1)
        check_even(c.name, tensor, dim, shard_size)
        dims[c.name] = DimShard(dim, tuple(tensor.shape))
        units[c.name] = tensor.numel() // shard_size
    return units, dims


def signature(collected: list[Collected], units: dict[str, int],
              dims: dict[str, DimShard], meshes: Mapping[str, DeviceMesh]) -> str:
    """What every rank must agree on before planning: names, shapes, dtypes, trainability,
    units, shard dims and the shapes and names of the meshes sharded over, in order (ranks
    that differ would plan different buffers)."""
    def mesh_of(name: str) -> list | None:
        mesh = meshes.get(name)
        return None if mesh is None else [list(mesh.shape), mesh.mesh_dim_names]

    return json.dumps([(c.name, list(c.param.shape), str(c.param.dtype), c.param.requires_grad,
                        units.get(c.name), dims[c.name].dim if c.name in dims else 0,
                        mesh_of(c.name))
                       for c in collected])


def _plans(members: list[Collected], stored: dict[str, torch.Tensor], units: dict[str, int],
           dims: dict[str, DimShard], shard_size: int, align: int, cost: int) -> list[Plan]:
    """The buckets of one kind: the dim-0 parameters planned together (in the order that pads
    least: :func:`~layout_planner.plan` with ``reorder``), and a bucket of its
    own for each ``Shard(d > 0)`` parameter, one chunk per rank (see :mod:`fsdp.dim_shard`;
    the collectives' alignment is dropped where the chunk does not keep it, since every rank
    boundary must fall exactly between chunks)."""
    def spec(c: Collected) -> TensorSpec:
        return TensorSpec(c.name, stored[c.name].numel(), units[c.name],
                          tuple(stored[c.name].shape))

    rows = [spec(c) for c in members if c.name not in dims]
    plans = (plan_buckets(rows, shard_size, align=align, bucket_cost=cost, reorder=True)
             if rows else [])
    for c in members:
        if c.name not in dims:
            continue
        chunk = units[c.name]
        plan = plan_buckets([spec(c)], shard_size, align=align if chunk % align == 0 else 1,
                            bucket_cost=cost)[0]
        expected = [(r * chunk, (r + 1) * chunk) for r in range(shard_size)]
        if [plan.local_range(c.name, r) for r in range(shard_size)] != expected:
            raise RuntimeError(f"fsdp: the plan of parameter {c.name!r} does not give every "
                               f"rank one chunk along dim {dims[c.name].dim}")
        plans.append(plan)
    return plans


def _stages(members: list[Collected], stored: dict[str, torch.Tensor],
            dims: dict[str, DimShard]) -> tuple[list[list[Collected]], set[str]]:
    """The trainable parameters of one kind in stages by backward order
    (:mod:`fsdp.backward_split`; ``Shard(d > 0)`` parameters, in buffers of their own anyway,
    go with the last), and the names in the stages a cut where the group's children are puts
    before their backward (none for other cuts)."""
    rows = [c for c in members if c.name not in dims]

    def after(c: Collected) -> bool:
        return c.after_children

    stages = backward_stages(rows, lambda c: stored[c.name].numel() * stored[c.name].itemsize,
                             lambda c: stored[c.name].dim() > 1, after_children=after)
    tail = ({c.name for stage in stages[:-1] for c in stage}
            if cut_by_children(rows, after) else set())
    stages[-1].extend(c for c in members if c.name in dims)
    return stages, tail


def build_group(collected: list[Collected], units: dict[str, int], mesh: DeviceMesh,
                param_meshes: Mapping[str, DeviceMesh] | None,
                device: torch.device, mp_policy: MixedPrecisionPolicy,
                label: str, layouts: dict[str, TPLayout] | None = None,
                dims: dict[str, DimShard] | None = None,
                backward_split: bool = True) -> FSDPParamGroup:
    """Plan, allocate and register the sharded parameters of one group.

    Every rank computes the same plans from the same parameter shapes (checked before, by
    ``fully_shard``); each DBuffer checks its plan again with one small collective.
    Tensor-parallel parameters (``layouts``, by name) are planned and stored as their TP-local
    tensors (:mod:`fsdp.tensor_parallel`); ``Shard(d > 0)`` parameters (``dims``, by name)
    dim-permuted, each in a buffer of its own (:mod:`fsdp.dim_shard`). With
    ``backward_split``, the trainable parameters of large groups and of groups around other
    groups go in stages of buffers by backward order (:mod:`fsdp.backward_split`).
    Parameters that ``param_meshes`` (by name; ``mesh`` for the others) puts on another mesh
    go in buffers of that mesh, which gather and reduce over it.
    """
    layouts = layouts or {}
    dims = dims or {}
    param_meshes = param_meshes or {}
    stored = {c.name: stored_tensor(c.param) for c in collected}
    stored.update((name, shard.stored(stored[name])) for name, shard in dims.items())
    kinds: dict[tuple[bool, torch.dtype, DeviceMesh], list[Collected]] = {}
    for c in collected:
        kinds.setdefault((*_kind(c.param), param_meshes.get(c.name, mesh)), []).append(c)
    managed: list[ManagedParam] = []
    buffers: list[DBuffer] = []
    uninitialised: list[DBuffer] = []  # built from meta parameters: nothing written yet
    shared: dict[str, str] = {}  # parameters another group manages: name -> its label
    tail: set[str] = set()  # the stages before a group's children's backward
    for (requires_grad, dtype, kind_mesh), members in kinds.items():
        shard_size = kind_mesh.size(kind_mesh.ndim - 1)
        compute, reduce = buffer_dtypes(dtype, mp_policy)
        by_name = {c.name: c for c in members}
        cost = shard_size * _BUCKET_COST_BYTES_PER_RANK // dtype.itemsize
        stages, before_children = (_stages(members, stored, dims)
                                   if requires_grad and backward_split else ([members], set()))
        tail |= before_children
        plans = [plan for stage in stages
                 for plan in _plans(stage, stored, units, dims, shard_size,
                                    _align((dtype, compute, reduce)), cost)]
        for plan in plans:
            names = [e.name for e in plan.entries]
            meta = [n for n in names if stored[n].is_meta]
            if meta and len(meta) != len(names):
                real = next(n for n in names if not by_name[n].param.is_meta)
                raise ValueError(
                    f"fully_shard: parameter {meta[0]!r} is on the meta device but {real!r} "
                    f"is on {by_name[real].param.device}; a group is initialised either from "
                    "real tensors or on the meta device (then to_empty() and init), not both")
            # Meta parameters stay on the meta device, as in FSDP2 (code that tests
            # ``p.is_meta`` to decide what to initialise must see them there): the buffer
            # holds no memory until ``to_empty`` rebuilds it on the real device.
            full = None if meta else {n: stored[n] for n in names}
            buffer = make_buffer(plan, kind_mesh,
                                 device=torch.device("meta") if meta else device,
                                 dtype=dtype, mp_policy=mp_policy,
                                 requires_grad=names if requires_grad else (),
                                 full_tensors=full)
            buffers.append(buffer)
            if meta:
                uninitialised.append(buffer)
            for name in names:
                c = by_name[name]
                layout, shard = layouts.get(name), dims.get(name)
                if shard is not None:  # Shard(d > 0): a Shard(d) DTensor over the same run
                    sharded = dim_shard.sharded_parameter(buffer, name, shard, requires_grad,
                                                          layout)
                    m = (DimShardManagedParam(name, c.slots, buffer, sharded, shard=shard)
                         if layout is None else
                         TPDimShardManagedParam(name, c.slots, buffer, sharded, layout=layout,
                                                shard=shard))
                elif layout is not None:  # tensor parallel: the combined-mesh DTensor
                    sharded = tensor_parallel.sharded_parameter(buffer, name, layout,
                                                                requires_grad)
                    m = TPManagedParam(name, c.slots, buffer, sharded, layout=layout)
                else:
                    sharded = sharded_parameter(buffer, name, requires_grad)
                    m = ManagedParam(name, c.slots, buffer, sharded)
                if c.shared_with is None:
                    setattr(c.param, _OWNER_ATTR, label)
                else:
                    shared[name] = c.shared_with
                setattr(sharded, _SHARDED_ATTR, True)
                m.register(sharded)
                managed.append(m)
    order = {c.name: i for i, c in enumerate(collected)}
    managed.sort(key=lambda m: order[m.name])
    group = FSDPParamGroup(managed, buffers, label, mp_policy)
    group.tail_indices = [i for i, b in enumerate(buffers)
                          if b.trainable and all(e.name in tail for e in b.plan.entries)]
    group.watch_uninitialised(uninitialised)
    group.shared_with = shared
    return group

