"""torch's optimizers and ``clip_grad_norm_`` on RaggedShard parameters against one process.

Each rank builds the same parameters and gradients (from the case's seeds) twice: as plain
full tensors, stepped by the optimizer in one process (the reference), and as RaggedShard
DTensors (units with zeros and one-hot), stepped by the same optimizer; every step its local
runs must equal the reference's slices within 1e-6. The same cases run on a 2-D mesh
``(Replicate(), RaggedShard)`` (HSDP) from ``test_hsdp_ops.py``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from tests.harness import device_mesh
from tests.ragged_dtensor.test_ops import (
    WORLD_SIZES,
    Layout,
    draw_layout,
    expected_ragged,
    full_of,
    ragged_from_full,
    use_mesh,
)

STEPS = 5

OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_for_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
    "sgd_momentum_for_loop": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=False, foreach=False),
}


def _params(layouts: list[Layout]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    full = [torch.nn.Parameter(full_of(lay.seed, lay.shape)) for lay in layouts]
    ragged = [torch.nn.Parameter(ragged_from_full(p.detach(), lay)) for p, lay in zip(full, layouts)]
    return full, ragged


def optimizer_cases(layouts: list[Layout], mesh_shape: tuple[int, ...]) -> int:
    """Every optimizer of OPTIMIZERS for STEPS steps; returns the number of checks."""
    use_mesh(device_mesh(*mesh_shape))
    checks = 0
    for name, make in OPTIMIZERS.items():
        full, ragged = _params(layouts)
        full_opt, ragged_opt = make(full), make(ragged)
        for step in range(STEPS):
            for p, q, lay in zip(full, ragged, layouts):
                grad = full_of(lay.seed * 31 + step, lay.shape)
                p.grad = grad
                q.grad = ragged_from_full(grad, lay)
            full_opt.step()
            ragged_opt.step()
            for p, q, lay in zip(full, ragged, layouts):
                expected_ragged(q.detach(), p.detach(), lay, f"{name} step {step} {lay}",
                                atol=1e-6, rtol=0)
                checks += 1
        # optimizer states shaped like a parameter (exp_avg, momentum_buffer, ...) stay ragged
        for q in ragged:
            for key, value in ragged_opt.state[q].items():
                if isinstance(value, DTensor) and value.shape == q.shape:
                    assert value.placements == q.placements, (name, key, value.placements)
    return checks


def draw_param_layouts(world: int, seed: int) -> list[Layout]:
    rng = random.Random(seed)
    layouts = [draw_layout(rng, world, seed * 100 + i) for i in range(3)]
    one_hot = [0] * world
    one_hot[rng.randrange(world)] = 2
    layouts.append(Layout(seed * 100 + 9, (4, 3), 1, tuple(one_hot)))
    return layouts


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_optimizers_match_single_device(ranks, world: int) -> None:
    layouts = draw_param_layouts(world, 60 + world)
    checks = ranks.run(world, optimizer_cases, layouts, (world,))
    assert checks == [len(OPTIMIZERS) * STEPS * len(layouts)] * world


def clip_cases(layouts: list[Layout], mesh_shape: tuple[int, ...]) -> int:
    """``clip_grad_norm_`` over RaggedShard, Shard(0) and Replicate DTensor parameters together:
    the total norm and the clipped gradients equal the single-device ones."""
    mesh = device_mesh(*mesh_shape)
    use_mesh(mesh)
    checks = 0
    plain_shapes = [(3, 3), (7,)]  # Shard(0) of 3 rows: an empty shard on 4 ranks
    for norm_type in (2.0, 1.0, math.inf):
        for foreach in (True, False):
            grads = [full_of(lay.seed + 5, lay.shape) for lay in layouts]
            grads += [full_of(77 + i, s) for i, s in enumerate(plain_shapes)]
            full = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for p, g in zip(full, grads):
                p.grad = g.clone()
            params = [torch.nn.Parameter(ragged_from_full(torch.zeros_like(g), lay))
                      for g, lay in zip(grads, layouts)]
            for p, g, lay in zip(params, grads, layouts):
                p.grad = ragged_from_full(g, lay)
            other = [(Shard(0),), (Replicate(),)]
            for g, placements in zip(grads[len(layouts):], other):
                placements = (Replicate(),) * (mesh.ndim - 1) + placements
                p = torch.nn.Parameter(torch_distribute_tensor(torch.zeros_like(g), mesh, placements))
                p.grad = torch_distribute_tensor(g.clone(), mesh, placements)
                params.append(p)
            want = torch.nn.utils.clip_grad_norm_(full, 0.5, norm_type, foreach=foreach)
            got = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type, foreach=foreach)
            what = f"norm {norm_type} foreach {foreach}"
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=what)
            for p, q, lay in zip(full, params, layouts):
                expected_ragged(q.grad, p.grad, lay, what, atol=1e-6, rtol=1e-5)
            for p, q in zip(full[len(layouts):], params[len(layouts):]):
                torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6)
            checks += 1
    return checks


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_clip_grad_norm_over_mixed_placements(ranks, world: int) -> None:
    layouts = draw_param_layouts(world, 70 + world)
    assert ranks.run(world, clip_cases, layouts, (world,)) == [6] * world
