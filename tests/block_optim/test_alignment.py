"""Alignment helpers: rank cuts of DTensor layouts in flat offsets, whether they fall on units,
and the nearest aligned layout, checked against brute force."""

from __future__ import annotations

import random
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from block_optim.alignment import (
    aligned_bounds,
    aligned_cuts,
    aligned_placements,
    cuts_on_units,
    flat_cuts,
    warn_once,
)
from ragged_dtensor import RaggedShard
from tests.harness import device_mesh


def test_aligned_bounds_moves_each_cut_to_the_nearest_unit_boundary() -> None:
    rng = random.Random(0)
    for _ in range(500):
        numel, unit, world = rng.randint(1, 3000), rng.choice([1, 7, 256]), rng.randint(1, 5)
        bounds = [0, *sorted(rng.randint(0, numel) for _ in range(world - 1)), numel]
        out = aligned_bounds(bounds, unit, numel)
        assert out[0] == 0 and out[-1] == numel and len(out) == len(bounds)
        assert all(a <= b for a, b in zip(out, out[1:]))
        for before, after in zip(bounds[1:-1], out[1:-1]):
            assert after % unit == 0 or after == numel
            # Nearest boundary (ties down), brute force over every candidate.
            candidates = [c for c in range(0, numel + 1) if c % unit == 0 or c == numel]
            best = min(candidates, key=lambda c: (abs(c - before), c))
            assert after == best
    with pytest.raises(ValueError, match="unit"):
        aligned_bounds((0, 5), 0, 5)


def _case_cuts() -> dict[str, Any]:
    world = dist.get_world_size()
    mesh = device_mesh(world)

    def make(shape: tuple[int, ...], placement: Any) -> DTensor:
        # Only the layout matters here; from_local checks a RaggedShard run's size, so give
        # it the right number of elements (the other placements are metadata-only probes).
        local_numel = (placement.local_numel(shape, dist.get_rank())
                       if isinstance(placement, RaggedShard) else 0)
        return DTensor.from_local(torch.empty(local_numel), mesh, [placement], shape=shape,
                                  stride=torch.empty(shape).stride(), run_check=False)

    ragged = make((10, 30), RaggedShard((0,), (2, 0, 3)))
    shard0 = make((10, 30), Shard(0))
    shard1 = make((10, 30), Shard(1))
    rep = make((10, 30), Replicate())
    return {
        "ragged": flat_cuts(ragged).bounds,
        "shard0": flat_cuts(shard0).bounds,
        "shard1": flat_cuts(shard1),
        "replicate": (flat_cuts(rep).mesh_dim, flat_cuts(rep).bounds),
        "ragged_on_60": cuts_on_units(ragged, 60),
        "ragged_on_7": cuts_on_units(ragged, 7),
        "shard1_on_1": cuts_on_units(shard1, 1),
        "replicate_on_256": cuts_on_units(rep, 256),
        "shard0_aligned": aligned_cuts(shard0, 64).bounds,
        "shard1_aligned": aligned_cuts(shard1, 64).bounds,
        "shard0_target": aligned_placements(shard0, 64),
        "replicate_target": aligned_placements(rep, 64),
    }


def test_flat_cuts_and_aligned_targets_on_three_ranks(ranks: Any) -> None:
    got = ranks.run(3, _case_cuts)[0]
    assert got["ragged"] == (0, 120, 120, 300)             # 2 + 0 + 3 units of 2 rows of 30
    assert got["shard0"] == (0, 120, 240, 300)             # torch.chunk: 4, 4, 2 rows
    assert got["shard1"] is None                           # column blocks are not flat runs
    assert got["replicate"] == (None, (0, 300))
    assert got["ragged_on_60"] and not got["ragged_on_7"]
    assert not got["shard1_on_1"] and got["replicate_on_256"]
    assert got["shard0_aligned"] == (0, 128, 256, 300)     # 120 -> 128, 240 -> 256
    assert got["shard1_aligned"] == (0, 128, 192, 300)     # even split 100, 200 -> 128, 192
    assert got["shard0_target"] == (RaggedShard.from_element_counts((10, 30), (128, 128, 44)),)
    assert got["replicate_target"] == (Replicate(),)


def test_warn_once_names_the_parameter_once() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            warn_once("TestTopic", "layers.0.w", "is misaligned")
        warn_once("TestTopic", "layers.1.w", "is misaligned")
    messages = [str(w.message) for w in caught]
    assert messages == ["TestTopic: parameter 'layers.0.w' is misaligned",
                        "TestTopic: parameter 'layers.1.w' is misaligned"]
