"""Rank-side cases shared by the sharded Muon and Shampoo tests (run by the ``ranks`` pools).

A *layout* says how a full tensor is placed on a 1-D mesh of ``world`` ranks:
``("ragged", k, counts)`` is ``RaggedShard(dims=(0..k-1), local_units=counts)``,
``("shard", d)`` is ``Shard(d)`` and ``("replicate",)`` is ``Replicate()``. Cases take full
tensors drawn in the parent, build sharded parameters, step, and return local tensors that the
parent assembles with :func:`assemble`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from ragged_dtensor import RaggedShard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

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


def shard(full: torch.Tensor, layout: Layout, world: int) -> torch.Tensor:
    mesh = device_mesh(world)
    placement = placement_of(layout)
    if isinstance(placement, RaggedShard):
        lo, hi = placement.flat_range(tuple(full.shape), dist.get_rank())
        return DTensor.from_local(full.reshape(-1)[lo:hi].clone(), mesh, [placement], shape=full.shape,
                                  stride=full.stride(), run_check=False)
    return distribute_tensor(full.clone(), mesh, [placement], src_data_rank=None)


def assemble(locals_: Sequence[torch.Tensor], shape: Sequence[int], layout: Layout) -> torch.Tensor:
    """Full tensor from per-rank local tensors (parent side)."""
    if layout[0] == "ragged":
        return torch.cat([t.reshape(-1) for t in locals_]).view(*shape)
    if layout[0] == "shard":
        return torch.cat(list(locals_), dim=layout[1])
    return locals_[0]


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class CallCounter:
    """Counts calls of ``torch.distributed`` collectives while active."""

    NAMES = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "broadcast", "all_gather",
             "reduce_scatter_tensor", "all_gather_object")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CallCounter:
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapped(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def step_sharded(
    optimizer: str,
    world: int,
    names: Sequence[str],
    fulls: Sequence[torch.Tensor],
    layouts: Sequence[Layout],
    grads: Sequence[Sequence[torch.Tensor]],
    kwargs: dict[str, Any],
    groups: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Step an optimizer on sharded parameters; return locals, collective counts and warnings."""
    params = [torch.nn.Parameter(shard(f, lay, world)) for f, lay in zip(fulls, layouts, strict=True)]
    named = list(zip(names, params, strict=True))
    spec: Any = named if groups is None else [
        {**g, "params": [named[i] for i in g["params"]]} for g in groups
    ]
    opt = OPTIMIZERS[optimizer](spec, **kwargs)
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step_grads in grads:
            for p, g, lay in zip(params, step_grads, layouts, strict=True):
                p.grad = shard(g, lay, world)
            with CallCounter() as counter:
                opt.step()
            counts.append(dict(counter.counts))
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
        return _step_single(optimizer, names, fulls, grads, kwargs, groups)
    finally:
        torch.set_num_threads(threads)


def _step_single(
    optimizer: str,
    names: Sequence[str],
    fulls: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor]],
    kwargs: dict[str, Any],
    groups: Sequence[dict[str, Any]] | None,
) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    named = list(zip(names, params, strict=True))
    spec: Any = named if groups is None else [
        {**g, "params": [named[i] for i in g["params"]]} for g in groups
    ]
    opt = OPTIMIZERS[optimizer](spec, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def non_finite_case(world: int, layout: Layout, bad_rank: int, optimizer: str) -> str:
    """A NaN gradient on one rank: every rank must raise the same named error."""
    import pytest

    full = torch.ones(6, 4, 5)
    param = torch.nn.Parameter(shard(full, layout, world))
    opt = OPTIMIZERS[optimizer]([("experts", param)])
    grad = shard(torch.ones(6, 4, 5), layout, world)
    if dist.get_rank() == bad_rank and local_of(grad).numel():
        local_of(grad)[0] = float("nan")
    param.grad = grad
    with pytest.raises(ValueError, match="parameter 'experts'") as info:
        opt.step()
    return str(info.value)


def checkpoint_case(
    optimizer: str,
    world: int,
    path: str,
    save: bool,
    names: Sequence[str],
    fulls: Sequence[torch.Tensor],
    layouts: Sequence[Layout],
    grads: Sequence[Sequence[torch.Tensor]],
    kwargs: dict[str, Any],
) -> list[torch.Tensor]:
    """Step an optimizer then save model and optimizer with DCP (``save``), or load them into a
    fresh layout (the tensors in ``fulls`` only give shapes) and keep stepping."""
    import torch.distributed.checkpoint as dcp

    start = fulls if save else [torch.zeros_like(f) for f in fulls]
    params = [torch.nn.Parameter(shard(f, lay, world)) for f, lay in zip(start, layouts, strict=True)]
    opt = OPTIMIZERS[optimizer](list(zip(names, params, strict=True)), **kwargs)
    if not save:
        opt.init_state()
        state = {"model": dict(zip(names, params, strict=True)), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        opt.load_state_dict(state["optim"])
    for step_grads in grads:
        for p, g, lay in zip(params, step_grads, layouts, strict=True):
            p.grad = shard(g, lay, world)
        opt.step()
    if save:
        dcp.save({"model": dict(zip(names, params, strict=True)), "optim": opt.state_dict()},
                 checkpoint_id=path)
    return [local_of(p.detach()).clone() for p in params]


def step_sharded_many(cases: Sequence[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """:func:`step_sharded` for several cases in one round trip."""
    return [step_sharded(*case) for case in cases]
