"""Rank-side cases shared by the sharded Muon and Shampoo tests (run by the ``ranks`` pools).

A *layout* says how a full tensor is placed on a 1-D mesh of ``world`` ranks:
``("ragged", k, counts)`` is ``RaggedShard(dims=(0..k-1), local_units=counts)``,
``("shard", d)`` is ``Shard(d)`` and ``("replicate",)`` is ``Replicate()``. With ``replicas``
above 1 the mesh is the HSDP mesh ``(replicas, world)`` and the placements are
``(Replicate(), layout)``. Cases take full tensors drawn in the parent, build sharded
parameters, step, and return local tensors that the parent assembles with :func:`assemble`
(HSDP: :func:`assemble_replicas`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from ragged_dtensor import RaggedShard, from_local_run, is_ragged
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from block_optim import Muon, Shampoo
from tests.harness import device_mesh

Layout = tuple[Any, ...]
OPTIMIZERS = {"Muon": Muon, "Shampoo": Shampoo}


def placement_of(layout: Layout) -> Any:
    if layout[0] == "ragged":
        return RaggedShard(tuple(range(layout[1])), layout[2])
    if layout[0] == "shard":
        return Shard(layout[1])
    return Replicate()


def shard(full: torch.Tensor, layout: Layout, world: int, replicas: int = 1) -> torch.Tensor:
    mesh = device_mesh(world) if replicas == 1 else device_mesh(replicas, world)
    placement = placement_of(layout)
    placements = [placement] if replicas == 1 else [Replicate(), placement]
    if is_ragged(placement):
        lo, hi = placement.flat_range(tuple(full.shape), mesh.get_local_rank(mesh.ndim - 1))
        return from_local_run(full.reshape(-1)[lo:hi].clone(), mesh, placements, full.shape)
    return distribute_tensor(full.clone(), mesh, placements, src_data_rank=None)


def assemble(locals_: Sequence[torch.Tensor], shape: Sequence[int], layout: Layout) -> torch.Tensor:
    """Full tensor from per-rank local tensors (parent side)."""
    if layout[0] == "ragged":
        return torch.cat([t.reshape(-1) for t in locals_]).view(*shape)
    if layout[0] == "shard":
        return torch.cat(list(locals_), dim=layout[1])
    return locals_[0]


def assemble_replicas(
    locals_: Sequence[torch.Tensor], shape: Sequence[int], layout: Layout, replicas: int
) -> list[torch.Tensor]:
    """One full tensor per replica of an HSDP run (parent side; rank ``r * world + s`` is
    replica ``r``, shard coordinate ``s``)."""
    world = len(locals_) // replicas
    return [assemble(locals_[r * world : (r + 1) * world], shape, layout) for r in range(replicas)]


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class CallCounter:
    """Counts calls of ``torch.distributed`` collectives while active, with the element count
    of each call's first tensor argument (the size of an all-reduce)."""

    NAMES = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "broadcast", "all_gather",
             "reduce_scatter_tensor", "all_gather_object")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.numels: dict[str, list[int]] = {name: [] for name in self.NAMES}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CallCounter:
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapped(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self.counts[_name] += 1
                first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
                self.numels[_name].append(-1 if first is None else first.numel())
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


class Collectives:
    """Counts every collective of a block, two ways: :class:`CallCounter` (``torch.distributed``
    calls, with sizes) and ``CommDebugMode`` (dispatcher-level c10d and functional
    collectives, which also sees DTensor's own, e.g. the all-gather of ``full_tensor()``)."""

    def __enter__(self) -> Collectives:
        self._calls = CallCounter().__enter__()
        self._comm = CommDebugMode().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._comm.__exit__(*exc)
        self._calls.__exit__(*exc)

    def report(self) -> dict[str, Any]:
        """``{"calls": {name: count} (non-zero only), "numels": {name: sizes}, "comm": {op: count}}``."""
        return {
            "calls": {k: v for k, v in self._calls.counts.items() if v},
            "numels": {k: v for k, v in self._calls.numels.items() if v},
            "comm": {str(k): v for k, v in self._comm.get_comm_counts().items() if v},
        }


def consensus_flag_numel() -> int:
    """Elements of ``ragged_dtensor.raise_on_any_rank``'s happy-path all-reduce: the size of the
    optimizers' non-finite consensus when no all-to-all carries the status (measured, so the
    collective-count tests follow the consensus helper's own flag layout)."""
    from ragged_dtensor import raise_on_any_rank

    with CallCounter() as calls:
        raise_on_any_rank(None)
    (numel,) = calls.numels["all_reduce"]
    return numel


def make_optimizer(
    optimizer: str,
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    kwargs: dict[str, Any],
    groups: Sequence[dict[str, Any]] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer over named ``params``; ``groups`` give parameter indices per group."""
    named = list(zip(names, params, strict=True))
    spec: Any = named if groups is None else [
        {**g, "params": [named[i] for i in g["params"]]} for g in groups
    ]
    return OPTIMIZERS[optimizer](spec, **kwargs)


@dataclass(frozen=True)
class ShardedRun:
    """Sharded parameters and their optimizer, as every rank builds them from data drawn in
    the parent.

    Attributes:
        optimizer: ``"Muon"`` or ``"Shampoo"``.
        world: Ranks of the mesh.
        names: Parameter names.
        fulls: Full initial tensors.
        layouts: Per parameter, its layout (module docstring).
        kwargs: Optimizer arguments.
        groups: Parameter groups as indices (:func:`make_optimizer`), or ``None``.
        replicas: Replicas of an HSDP mesh ``(replicas, world)``; 1 for a 1-D mesh.
    """

    optimizer: str
    world: int
    names: Sequence[str]
    fulls: Sequence[torch.Tensor]
    layouts: Sequence[Layout]
    kwargs: dict[str, Any]
    groups: Sequence[dict[str, Any]] | None = None
    replicas: int = 1

    def build(self, fulls: Sequence[torch.Tensor] | None = None) -> tuple[list[torch.nn.Parameter], Any]:
        """This rank's parameters (from ``fulls``, default the run's) and a fresh optimizer."""
        params = [torch.nn.Parameter(shard(f, lay, self.world, self.replicas))
                  for f, lay in zip(self.fulls if fulls is None else fulls, self.layouts, strict=True)]
        return params, make_optimizer(self.optimizer, self.names, params, self.kwargs, self.groups)

    def set_grads(self, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
        """Shard full gradients onto ``params`` (no communication)."""
        for p, g, lay in zip(params, grads, self.layouts, strict=True):
            p.grad = shard(g, lay, self.world, self.replicas)

    def step(self, params: Sequence[torch.nn.Parameter], opt: Any, grads: Sequence[torch.Tensor]) -> None:
        """:meth:`set_grads`, then step."""
        self.set_grads(params, grads)
        opt.step()


def step_sharded(run: ShardedRun, grads: Sequence[Sequence[torch.Tensor]]) -> dict[str, Any]:
    """Step a run; return locals, per-step collectives (:meth:`Collectives.report`) and warnings."""
    params, opt = run.build()
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step_grads in grads:
            run.set_grads(params, step_grads)
            with Collectives() as collectives:
                opt.step()
            counts.append(collectives.report())
    return {
        "locals": [local_of(p.detach()).clone() for p in params],
        "counts": counts,
        "warnings": [str(w.message) for w in caught],
    }


def step_single(
    optimizer: str,
    names: Sequence[str],
    fulls: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor]],
    kwargs: dict[str, Any],
    groups: Sequence[dict[str, Any]] | None = None,
) -> list[torch.Tensor]:
    """The single-device reference run (parent side), on one thread like the ranks: a
    matmul's bits can depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
        opt = make_optimizer(optimizer, names, params, kwargs, groups)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params]
    finally:
        torch.set_num_threads(threads)


def non_finite_case(world: int, layout: Layout, bad_rank: int, optimizer: str, replicas: int = 1) -> str:
    """A NaN gradient on one rank: every rank must raise the same named error."""
    import pytest

    full = torch.ones(6, 4, 5)
    param = torch.nn.Parameter(shard(full, layout, world, replicas))
    opt = OPTIMIZERS[optimizer]([("experts", param)])
    grad = shard(torch.ones(6, 4, 5), layout, world, replicas)
    if dist.get_rank() == bad_rank and local_of(grad).numel():
        local_of(grad)[0] = float("nan")
    param.grad = grad
    with pytest.raises(ValueError, match="parameter 'experts'") as info:
        opt.step()
    return str(info.value)


def checkpoint_case(
    run: ShardedRun, path: str, save: bool, grads: Sequence[Sequence[torch.Tensor]]
) -> list[torch.Tensor]:
    """Step a run then save model and optimizer with DCP (``save``), or load them into a fresh
    layout (the run's ``fulls`` only give shapes) and keep stepping."""
    import torch.distributed.checkpoint as dcp

    params, opt = run.build(None if save else [torch.zeros_like(f) for f in run.fulls])
    if not save:
        opt.init_state()
        state = {"model": dict(zip(run.names, params, strict=True)), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        opt.load_state_dict(state["optim"])
    for step_grads in grads:
        run.step(params, opt, step_grads)
    if save:
        dcp.save({"model": dict(zip(run.names, params, strict=True)), "optim": opt.state_dict()},
                 checkpoint_id=path)
    return [local_of(p.detach()).clone() for p in params]


def snapshot(opt: torch.optim.Optimizer) -> list[Any]:
    """Every parameter's and every state entry's value (local tensors cloned), in a fixed order."""

    def frozen(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return local_of(value.detach()).clone()
        if isinstance(value, dict):
            return {k: frozen(v) for k, v in sorted(value.items())}
        return value

    params = [p for group in opt.param_groups for p in group["params"]]
    return [(frozen(p), frozen(dict(opt.state.get(p, {})))) for p in params]


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two :func:`snapshot` values (dtypes, shapes, bits, dict keys)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def failed_step_case(
    run: ShardedRun, good: Sequence[Sequence[torch.Tensor]], bad: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """Steps ``bad, good[0], bad, good[1:]`` on one optimizer and ``good`` on a fresh one.

    Returns per failing step whether the snapshot after it equals the one before (bitwise) and
    the error message, and whether both optimizers end bitwise equal."""
    import pytest

    params, opt = run.build()
    unchanged, messages = [], []
    for grads in [bad, good[0], bad, *good[1:]]:
        if grads is not bad:
            run.step(params, opt, grads)
            continue
        before = snapshot(opt)
        with pytest.raises(ValueError) as info:
            run.step(params, opt, grads)
        unchanged.append(same(before, snapshot(opt)))
        messages.append(str(info.value))
    fresh_params, fresh = run.build()
    for grads in good:
        run.step(fresh_params, fresh, grads)
    return {"unchanged": unchanged, "messages": messages, "as_fresh": same(snapshot(opt), snapshot(fresh))}


def unsynced_non_finite_case(world: int, layout: Layout, bad_rank: int) -> dict[str, Any]:
    """Muon with ``sync_nonfinite_check=False`` on whole experts: a NaN raises on its rank only,
    and no step issues a collective."""
    full = torch.ones(6, 4, 5)
    param = torch.nn.Parameter(shard(full, layout, world))
    opt = Muon([("experts", param)], ns_dtype=torch.float32, sync_nonfinite_check=False)
    param.grad = shard(full, layout, world)
    with Collectives() as finite:
        opt.step()
    grad = shard(full, layout, world)
    if dist.get_rank() == bad_rank:
        local_of(grad)[0] = float("nan")
    param.grad = grad
    message = None
    with Collectives() as failing:
        try:
            opt.step()
        except ValueError as error:
            message = str(error)
    return {"message": message, "counts": [finite.report(), failing.report()]}


def step_sharded_many(
    cases: Sequence[tuple[ShardedRun, Sequence[Sequence[torch.Tensor]]]],
) -> list[dict[str, Any]]:
    """:func:`step_sharded` for several ``(run, grads)`` in one round trip."""
    return [step_sharded(run, grads) for run, grads in cases]
