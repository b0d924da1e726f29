"""torch's optimizers and ``clip_grad_norm_`` on RaggedShard parameters against one process.

Each rank builds the same parameters and gradients (from the case's seeds) twice: as plain
full tensors, stepped by the optimizer in one process (the reference), and as RaggedShard
DTensors (units with zeros and one-hot), stepped by the same optimizer; every step its local
runs must equal the reference's slices within 1e-6. The same cases run on a 2-D mesh
``(Replicate(), RaggedShard)`` (HSDP) from ``test_hsdp_ops.py``.
"""

from __future__ import annotations

import random

import pytest
import torch.distributed as dist

from tests.harness import device_mesh
from tests.ragged_dtensor.cases import Layout
from tests.ragged_dtensor.op_cases import (
    OPTIMIZERS,
    STEPS,
    WORLD_SIZES,
    clip_cases,
    draw_param_layouts,
    foreach_cases,
    optimizer_cases,
)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_optimizers_match_single_device(ranks, world: int) -> None:
    layouts = draw_param_layouts(world, 60 + world)
    checks = ranks.run(world, optimizer_cases, layouts, (world,))
    assert checks == [len(OPTIMIZERS) * STEPS * len(layouts)] * world


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_clip_grad_norm_over_mixed_placements(ranks, world: int) -> None:
    layouts = draw_param_layouts(world, 70 + world)
    assert ranks.run(world, clip_cases, layouts, (world,)) == [6] * world


def same_shape_layouts(world: int, seed: int) -> list[Layout]:
    """Tensors of ONE shape under different RaggedShards (dims and units): a foreach list whose
    outputs must each keep their own placement, not the first tensor's."""
    rng = random.Random(seed)
    shape = (12, 5)
    layouts = [Layout(seed, shape, 1, (1,) * world),
               Layout(seed + 1, shape, 2, tuple(int(r == world - 1) for r in range(world)))]
    while len(layouts) < 4:
        k = rng.choice([1, 2])
        units = tuple(rng.choice([0, 1, 2, 3]) for _ in range(world))
        rows = 12 if k == 1 else 60
        if not sum(units) or rows % sum(units):
            continue
        layout = Layout(seed + len(layouts), shape, k, units)
        if layout.placement not in [lay.placement for lay in layouts]:
            layouts.append(layout)
    return layouts


def same_shape_cases(layouts: list[Layout]) -> list[int]:
    mesh_shape = (device_mesh(dist.get_world_size()).size(),)
    return [optimizer_cases(layouts, mesh_shape), foreach_cases([layouts], mesh_shape)]


@pytest.mark.parametrize("world", (2, 3))
def test_optimizers_and_foreach_on_same_shaped_tensors_of_other_layouts(ranks, world: int) -> None:
    layouts = same_shape_layouts(world, 300 + world)
    assert len({lay.placement for lay in layouts}) == len(layouts)
    expected = [len(OPTIMIZERS) * STEPS * len(layouts), 11 * len(layouts) + 3]
    assert ranks.run(world, same_shape_cases, layouts) == [expected] * world
