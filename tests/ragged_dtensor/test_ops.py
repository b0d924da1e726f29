"""Ops on RaggedShard DTensors on 1..4 gloo ranks, each checked against the full tensor.

Cases (shapes with prime sizes, ``local_units`` with zeros and one-hot) are drawn in the parent
with a fixed seed and batched, one ``ranks.run`` per world size and test. Every rank rebuilds
the full tensors from the case's seed, runs the op on plain tensors as the reference and
checks its own local piece against a slice of the reference computed in the test (not by the
library).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from tests.harness import device_mesh
from tests.ragged_dtensor.cases import (
    Layout,
    draw_layout,
    draw_layouts,
    expected_ragged,
    full_of,
    mesh_of,
    ragged_from_full,
)
from tests.ragged_dtensor.op_cases import (
    IN_PLACE,
    OUT_OF_PLACE,
    REDUCTIONS,
    WORLD_SIZES,
    elementwise_cases,
    foreach_cases,
    reduction_cases,
)


# ---- elementwise ops -----------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLD_SIZES)
def test_elementwise_ops_keep_ragged_placement(ranks, world: int) -> None:
    layouts = draw_layouts(world, 2, seed=10 + world)
    assert ranks.run(world, elementwise_cases, layouts) == [
        len(layouts) * (len(OUT_OF_PLACE) + len(IN_PLACE))
    ] * world


# ---- _foreach_* ops ------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_foreach_ops(ranks, world: int) -> None:
    rng = random.Random(20 + world)
    layout_lists = [
        [draw_layout(rng, world, 100 * i + j) for j in range(3)] for i in range(3)
    ]
    checks = ranks.run(world, foreach_cases, layout_lists)
    assert checks == [3 * (11 * 3 + 3)] * world


# ---- no communication ----------------------------------------------------------------------


def collective_count_case(layout: Layout) -> tuple[int, int]:
    """(collectives during every elementwise and foreach op, collectives of one sum().full_tensor()).

    The second number is the positive control: the counter does see DTensor collectives.
    """
    mesh = device_mesh(dist.get_world_size())
    fa, fb = full_of(layout.seed, layout.shape), full_of(layout.seed + 1, layout.shape)
    s = torch_distribute_tensor(full_of(3, ()), mesh, [Replicate()])
    a, b = ragged_from_full(mesh, fa, layout), ragged_from_full(mesh, fb, layout)
    replicate_b = torch_distribute_tensor(fb, mesh, [Replicate()])
    with CommDebugMode() as mode:
        for op in OUT_OF_PLACE.values():
            op(a, b, s)
        for op in IN_PLACE.values():
            op(ragged_from_full(mesh, fa, layout), b, s)
        torch._foreach_add_([a, b], [b, a], alpha=0.5)
        torch._foreach_lerp_([a], [b], 0.5)
        torch._foreach_mul_([a, b], 0.5)
        # a full-shape Replicate operand is sliced locally into the ragged layout
        a.add_(replicate_b)
    quiet = mode.get_total_counts()
    with CommDebugMode() as mode:
        a.sum().full_tensor()
    return quiet, mode.get_total_counts()


@pytest.mark.parametrize("world", (2, 4))
def test_elementwise_ops_use_no_collective(ranks, world: int) -> None:
    layout = draw_layouts(world, 1, seed=30 + world)[0]
    for quiet, control in ranks.run(world, collective_count_case, layout):
        assert quiet == 0
        assert control >= 1


# ---- reductions ----------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLD_SIZES)
def test_full_reductions_match_single_device(ranks, world: int) -> None:
    rng = random.Random(40 + world)
    layouts = draw_layouts(world, 3, seed=40 + world)
    # one layout where every rank but one holds zero units (no-identity reductions)
    one_hot = [0] * world
    one_hot[rng.randrange(world)] = 1
    layouts.append(Layout(4242, (5, 3), 1, tuple(one_hot)))
    assert ranks.run(world, reduction_cases, layouts) == [len(layouts) * 2 * len(REDUCTIONS)] * world


# ---- other placements, fallbacks and rejected ops ------------------------------------------


def mixing_cases(layouts: list[Layout]) -> int:
    mesh = device_mesh(dist.get_world_size())
    world = dist.get_world_size()
    checks = 0
    for i, layout in enumerate(layouts):
        fa, fb = full_of(layout.seed, layout.shape), full_of(layout.seed + 1, layout.shape)
        a = ragged_from_full(mesh, fa, layout)
        # same shape, other placements: brought to a's placement, result stays ragged
        replicate_b = torch_distribute_tensor(fb, mesh, [Replicate()])
        shard_b = torch_distribute_tensor(fb, mesh, [Shard(0)])
        units = [0] * world
        units[i % world] = 1
        one_hot = Layout(layout.seed, layout.shape, 1, tuple(units))
        other_b = ragged_from_full(mesh, fb, one_hot)
        for name, b in (("replicate", replicate_b), ("shard0", shard_b), ("other ragged", other_b)):
            expected_ragged(a + b, fa + fb, layout, f"a + {name} {layout}")
            expected_ragged(a.clone().mul_(b), fa * fb, layout, f"a.mul_({name}) {layout}")
            checks += 2
        # the other operand first: the first ragged operand still decides the output layout
        expected_ragged(replicate_b * a, fb * fa, layout, f"replicate * a {layout}")
        # a non-ragged tensor updated in place from a ragged one (the ragged one is gathered)
        target = torch_distribute_tensor(fb.clone(), mesh, [Replicate()])
        target.add_(a)
        assert target.placements == (Replicate(),)
        torch.testing.assert_close(target.full_tensor(), fb + fa)
        checks += 2
        # dim-wise semantics: computed on the gathered tensor, correct but Replicate
        row = full_of(layout.seed + 2, layout.shape[-1:])
        row_dt = torch_distribute_tensor(row, mesh, [Replicate()])
        gathered = {
            "broadcast row": (a + row_dt, fa + row),
            "sum over dim 0": (a.sum(dim=0), fa.sum(dim=0)),
            "reshape": (a.reshape(-1), fa.reshape(-1)),
            "cumsum": (a.cumsum(-1), fa.cumsum(-1)),
        }
        if len(layout.shape) == 2:
            mat = full_of(layout.seed + 3, (layout.shape[1], 4))
            gathered["matmul"] = (a @ torch_distribute_tensor(mat, mesh, [Replicate()]), fa @ mat)
        for name, (got, want) in gathered.items():
            torch.testing.assert_close(got.full_tensor(), want, msg=f"{name} {layout}")
            checks += 1
        # an in-place op that would need a gather is refused on every rank, a left intact
        before = a.to_local().clone()
        if len(layout.shape) > 1 and layout.shape[-1] > 1:
            with pytest.raises(RuntimeError, match="cannot run on RaggedShard inputs in place"):
                a.add_(row_dt)
        with pytest.raises(RuntimeError, match="cannot run on RaggedShard inputs in place"):
            a.cumsum_(0)
        assert torch.equal(a.to_local(), before) and a.placements[-1] == layout.placement
        checks += 1
    return checks


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_mixing_placements_redistributes_gathers_or_raises(ranks, world: int) -> None:
    layouts = draw_layouts(world, 3, seed=50 + world, max_ndim=2)
    results = ranks.run(world, mixing_cases, layouts)
    assert len(set(results)) == 1 and results[0] >= len(layouts) * 8


# ---- autograd through ops ------------------------------------------------------------------

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mul_sum": lambda x, y: (x * y).sum(),
    "sqrt_abs": lambda x, y: x.abs().add(1).sqrt().sum(),
    "norm": lambda x, y: torch.linalg.vector_norm(x),
    "inf_norm": lambda x, y: torch.linalg.vector_norm(x * y, math.inf),
    "mean_of_lerp": lambda x, y: torch.lerp(x, y, 0.3).mean(),
    "max": lambda x, y: x.max(),
    "several_terms": lambda x, y: (x * y).sum() + torch.linalg.vector_norm(x) + (x * 3).mean(),
}


def autograd_cases(layouts: list[Layout]) -> int:
    """Gradients of losses built from elementwise ops and reductions equal the full tensor's."""
    mesh = mesh_of(None)
    checks = 0
    for layout in layouts:
        fa, fb = full_of(layout.seed, layout.shape), full_of(layout.seed + 1, layout.shape)
        for name, loss_fn in LOSSES.items():
            a = ragged_from_full(mesh, fa, layout, requires_grad=True)
            b = ragged_from_full(mesh, fb, layout)
            loss = loss_fn(a, b)
            loss.backward()
            ref = fa.clone().requires_grad_(True)
            ref_loss = loss_fn(ref, fb)
            ref_loss.backward()
            torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), msg=name)
            torch.testing.assert_close(a.grad.full_tensor(), ref.grad, msg=f"{name} {layout}")
            checks += 1
    return checks


@pytest.mark.parametrize("world", (1, 3))
def test_gradients_through_ops(ranks, world: int) -> None:
    layouts = draw_layouts(world, 2, seed=90 + world)
    assert ranks.run(world, autograd_cases, layouts) == [len(layouts) * len(LOSSES)] * world


# ---- random fills --------------------------------------------------------------------------


def random_fill_case(layout: Layout) -> bool:
    """In-place random fills (parameter init) run locally: placement kept, every element drawn."""
    mesh = mesh_of(None)
    x = ragged_from_full(mesh, torch.full(layout.shape, -5.0), layout)
    with CommDebugMode() as mode:
        x.uniform_(0.0, 1.0)
        y = torch.nn.init.normal_(ragged_from_full(mesh, torch.zeros(layout.shape), layout), 3.0, 0.1)
    assert mode.get_total_counts() == 0
    assert x.placements[-1] == layout.placement and y.placements[-1] == layout.placement
    full_x, full_y = x.full_tensor(), y.full_tensor()
    assert bool(((full_x >= 0) & (full_x < 1)).all()), "uniform_ left elements unfilled"
    assert bool(((full_y - 3.0).abs() < 1.0).all()), "normal_ left elements unfilled"
    return True


@pytest.mark.parametrize("world", (2, 4))
def test_random_fills_stay_local(ranks, world: int) -> None:
    layout = draw_layouts(world, 1, seed=95 + world)[0]
    assert ranks.run(world, random_fill_case, layout) == [True] * world
