"""Shampoo on sharded parameters (1-4 gloo ranks) against the single-device optimizer."""

from __future__ import annotations

import random

import pytest
import torch

from tests.block_optim.matrix_cases import (
    ShardedRun,
    assemble,
    checkpoint_case,
    consensus_flag_numel,
    non_finite_case,
    step_sharded,
    step_sharded_many,
    step_single,
)
from tests.block_optim.test_muon_sharded import composition

SHAPES = {
    "w": (12, 6), "w_cut": (10, 7), "experts": (3, 8, 5), "experts_cut": (2, 6, 4), "bias": (9,),
    "w_shard0": (9, 5), "w_rep": (6, 6), "w_shard1": (8, 6),
}
NAMES = list(SHAPES)
KWARGS = {"lr": 0.01, "weight_decay": 0.1, "max_preconditioner_dim": 4, "start_preconditioning_step": 2,
          "precondition_frequency": 2}


def draw_layouts(world: int, seed: int) -> dict[str, tuple]:
    rng = random.Random(seed)
    return {
        "w": ("ragged", 1, tuple(4 * c for c in composition(rng, 3, world))),  # whole 4-row bands
        "w_cut": ("ragged", 1, composition(rng, 10, world)),
        "experts": ("ragged", 1, composition(rng, 3, world)),
        "experts_cut": ("ragged", 2, composition(rng, 12, world)),
        "bias": ("ragged", 1, composition(rng, 9, world)),
        "w_shard0": ("shard", 0),
        "w_rep": ("replicate",),
        "w_shard1": ("shard", 1),
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_equals_single_device_bitwise(ranks, world: int) -> None:
    # Three random layouts per world size (uneven, zero-unit ranks), one round trip.
    draws = []
    for k in range(3):
        gen = torch.Generator().manual_seed(10 * world + k)
        fulls = [torch.randn(s, generator=gen) for s in SHAPES.values()]
        grads = [[torch.randn(s, generator=gen) for s in SHAPES.values()] for _ in range(5)]
        draws.append((fulls, grads, draw_layouts(world, 200 * world + k)))
    cases = [(ShardedRun("Shampoo", world, NAMES, fulls, list(layouts.values()), KWARGS), grads)
             for fulls, grads, layouts in draws]
    results = ranks.run(world, step_sharded_many, cases)
    for k, (fulls, grads, layouts) in enumerate(draws):
        expected = step_single("Shampoo", NAMES, fulls, grads, KWARGS)
        for i, name in enumerate(NAMES):
            got = assemble([r[k]["locals"][i] for r in results], SHAPES[name], layouts[name])
            assert torch.equal(got, expected[i]), (k, name, layouts[name])


def test_aligned_bands_need_no_all_to_all(ranks) -> None:
    shapes = {"w": (12, 6), "experts": (3, 8, 5)}
    layouts = [("ragged", 1, (4, 0, 8)), ("ragged", 1, (1, 2, 0))]
    gen = torch.Generator().manual_seed(9)
    fulls = [torch.randn(s, generator=gen) for s in shapes.values()]
    grads = [[torch.randn(s, generator=gen) for s in shapes.values()] for _ in range(3)]
    results = ranks.run(3, step_sharded, ShardedRun("Shampoo", 3, list(shapes), fulls, layouts, KWARGS), grads)
    expected = step_single("Shampoo", list(shapes), fulls, grads, KWARGS)
    flag = ranks.run(3, consensus_flag_numel)[0]
    for counts in results[0]["counts"]:  # no all-to-all; the non-finite consensus flag only
        assert counts["calls"] == {"all_reduce": 1} and counts["numels"] == {"all_reduce": [flag]}, counts
        assert counts["comm"] == {"c10d.allreduce_": 1}, counts
    for i, name in enumerate(shapes):
        assert torch.equal(assemble([r["locals"][i] for r in results], shapes[name], layouts[i]), expected[i])
    assert results[0]["warnings"] == []


def test_cut_band_warns_once_and_is_moved(ranks) -> None:
    shapes = {"band_cut": (10, 7)}
    layouts = [("ragged", 1, (3, 7, 0))]
    gen = torch.Generator().manual_seed(10)
    fulls = [torch.randn(10, 7, generator=gen)]
    grads = [[torch.randn(10, 7, generator=gen)] for _ in range(3)]
    results = ranks.run(3, step_sharded, ShardedRun("Shampoo", 3, list(shapes), fulls, layouts, KWARGS), grads)
    assert [c["calls"] for c in results[0]["counts"]] == [{"all_to_all_single": 2}] * 3
    assert [c["comm"] for c in results[0]["counts"]] == [{"c10d.alltoall_base_": 2}] * 3
    assert len(results[0]["warnings"]) == 1 and "'band_cut'" in results[0]["warnings"][0]
    expected = step_single("Shampoo", list(shapes), fulls, grads, KWARGS)
    assert torch.equal(assemble([r["locals"][0] for r in results], (10, 7), layouts[0]), expected[0])


def test_non_finite_gradient_is_raised_on_every_rank(ranks) -> None:
    messages = ranks.run(3, non_finite_case, 3, ("ragged", 2, (10, 7, 7)), 1, "Shampoo")
    assert all("gradient of parameter 'experts'" in m for m in messages)


@pytest.mark.parametrize("layouts", [
    ([("shard", 0), ("replicate",), ("shard", 0)], [("shard", 0), ("shard", 0), ("replicate",)]),
    ([("ragged", 1, (4, 0, 4, 4)), ("ragged", 2, (3, 5, 0, 8)), ("ragged", 1, (3, 3, 0, 2))],
     [("ragged", 1, (8, 4)), ("ragged", 1, (1, 1)), ("ragged", 1, (0, 8))]),
], ids=["shard_replicate", "ragged"])
def test_checkpoint_reloads_under_another_world_size(ranks, tmp_path, layouts) -> None:
    save_layouts, load_layouts = layouts
    names = ["w", "experts", "bias"]
    shapes = [(12, 6), (2, 8, 5), (8,)]
    gen = torch.Generator().manual_seed(12)
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    ranks.run(4, checkpoint_case, ShardedRun("Shampoo", 4, names, fulls, save_layouts, KWARGS), str(tmp_path), True,
              grads[:3])
    results = ranks.run(2, checkpoint_case, ShardedRun("Shampoo", 2, names, fulls, load_layouts, KWARGS),
                        str(tmp_path), False, grads[3:])
    expected = step_single("Shampoo", names, fulls, grads, KWARGS)
    for i, shape in enumerate(shapes):
        got = assemble([r[i] for r in results], shape, load_layouts[i])
        assert torch.equal(got, expected[i]), names[i]
