"""The ops, ``_foreach_*``, reductions, optimizers, ``clip_grad_norm_`` and DCP cases of the 1-D
tests, on the HSDP layout ``(Replicate(), RaggedShard(...))`` of a 2x2 mesh (4 gloo ranks)."""

from __future__ import annotations

import random

import torch
import torch.distributed.checkpoint as dcp
from tests.ragged_dtensor.cases import (
    KS,
    KS_OTHER,
    SHAPES,
    Layout,
    draw_layout,
    expected_ragged,
    full_of,
    layouts_for,
    mesh_of,
    ragged_from_full,
)
from tests.ragged_dtensor.op_cases import (
    IN_PLACE,
    OPTIMIZERS,
    OUT_OF_PLACE,
    REDUCTIONS,
    STEPS,
    clip_cases,
    draw_param_layouts,
    elementwise_cases,
    foreach_cases,
    optimizer_cases,
    reduction_cases,
)


MESH = (2, 2)
WORLD = 4
RAGGED_RANKS = MESH[-1]


def hsdp_cases(layouts: list[Layout], layout_lists: list[list[Layout]]) -> list[int]:
    return [
        elementwise_cases(layouts, MESH),
        foreach_cases(layout_lists, MESH),
        reduction_cases(layouts, MESH),
        optimizer_cases(layouts, MESH),
        clip_cases(layouts, MESH),
    ]


def test_hsdp_ops_optimizers_and_clip(ranks) -> None:
    layouts = draw_param_layouts(RAGGED_RANKS, 80)
    rng = random.Random(81)
    layout_lists = [[draw_layout(rng, RAGGED_RANKS, 900 + j) for j in range(3)]]
    results = ranks.run(WORLD, hsdp_cases, layouts, layout_lists)
    expected = [
        len(layouts) * (len(OUT_OF_PLACE) + len(IN_PLACE)),
        11 * 3 + 3,
        len(layouts) * 2 * len(REDUCTIONS),
        len(OPTIMIZERS) * STEPS * len(layouts),
        6,
    ]
    assert results == [expected] * WORLD


def hsdp_save_case(path: str, layouts: list[Layout]) -> None:
    mesh = mesh_of(MESH)
    state = {f"t{i}": ragged_from_full(mesh, full_of(lay.seed, lay.shape), lay)
             for i, lay in enumerate(layouts)}
    dcp.save(state, checkpoint_id=path)


def hsdp_load_case(path: str, layouts: list[Layout], mesh_shape: tuple[int, ...]) -> int:
    mesh = mesh_of(mesh_shape)
    state = {f"t{i}": ragged_from_full(mesh, torch.zeros(lay.shape), lay) for i, lay in enumerate(layouts)}
    dcp.load(state, checkpoint_id=path)
    for i, lay in enumerate(layouts):
        expected_ragged(state[f"t{i}"], full_of(lay.seed, lay.shape), lay, f"{lay}", atol=0, rtol=0)
        torch.testing.assert_close(state[f"t{i}"].full_tensor(), full_of(lay.seed, lay.shape))
    return len(layouts)


def test_hsdp_dcp_round_trip(ranks, tmp_path) -> None:
    """Save from HSDP (replicas write each box once), load into HSDP with other units and into
    a 1-D RaggedShard on 3 ranks."""
    path = str(tmp_path / "hsdp")
    saved = layouts_for(RAGGED_RANKS, SHAPES, KS, seed=7)
    ranks.run(WORLD, hsdp_save_case, path, saved)
    for world, mesh_shape, seed in ((4, MESH, 8), (3, (3,), 9)):
        other = [Layout(s.seed, s.shape, lay.k, lay.units)
                 for s, lay in zip(saved, layouts_for(mesh_shape[-1], SHAPES, KS_OTHER, seed))]
        assert ranks.run(world, hsdp_load_case, path, other, mesh_shape) == [len(SHAPES)] * world

