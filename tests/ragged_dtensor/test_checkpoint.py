"""DCP checkpoints of RaggedShard DTensors: the box split, save without gathering, and loading
into other world sizes, ``local_units`` and placements, against the full tensors."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from ragged_dtensor.flat_boxes import flat_range_boxes
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import (
    KS,
    KS_OTHER,
    SHAPES,
    Layout,
    expected_ragged,
    full_of,
    layouts_for,
    ragged_from_full,
)

# ---- the box split (pure) ------------------------------------------------------------------


def _cells(shape: tuple[int, ...], start: int, end: int) -> set[tuple[int, ...]]:
    return {tuple(int(i) for i in torch.unravel_index(torch.tensor(f), shape)) for f in range(start, end)}


def _box_cells(box) -> set[tuple[int, ...]]:
    offsets, sizes = box
    return set(itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes))))


def _fewest_boxes(region: set[tuple[int, ...]], shape: tuple[int, ...], limit: int) -> int:
    """Exhaustive minimum partition of ``region`` into boxes (the lowest free cell is always
    the lowest corner of its box), as an independent reference."""
    best = [limit]

    def search(free: frozenset, count: int) -> None:
        if not free:
            best[0] = min(best[0], count)
            return
        if count + 1 >= best[0]:
            return
        corner = min(free)
        for ends in itertools.product(*(range(c + 1, n + 1) for c, n in zip(corner, shape))):
            box = set(itertools.product(*(range(c, e) for c, e in zip(corner, ends))))
            if box <= free:
                search(free - box, count + 1)

    search(frozenset(region), 0)
    return best[0]


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 2, 2), (2, 3, 3), (3, 2, 2, 1)])
def test_boxes_are_an_exact_minimal_partition(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    rng = random.Random(hash(shape) % 1000)
    ranges = [(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    for start, end in rng.sample(ranges, min(len(ranges), 60)):
        boxes = flat_range_boxes(shape, start, end)
        cells = [c for box in boxes for c in _box_cells(box)]
        assert len(cells) == len(set(cells)), (shape, start, end, boxes)
        assert set(cells) == _cells(shape, start, end), (shape, start, end, boxes)
        assert _fewest_boxes(set(cells), shape, len(boxes)) == len(boxes), (shape, start, end)


def test_boxes_of_large_runs_cover_exactly() -> None:
    rng = random.Random(5)
    for shape in [(1000, 4096), (13, 17, 19), (6, 50, 70, 3)]:
        n = math.prod(shape)
        for _ in range(20):
            start, end = sorted(rng.randrange(n + 1) for _ in range(2))
            boxes = flat_range_boxes(shape, start, end)
            assert sum(math.prod(s) for _, s in boxes) == end - start
            assert len(boxes) <= 2 * len(shape) - 1
    # whole prefix rows of a 2-D weight: always one box
    assert flat_range_boxes((12, 5), 15, 40) == [((3, 0), (5, 5))]
    assert flat_range_boxes((12, 5), 7, 7) == []


# ---- DCP across world sizes ----------------------------------------------------------------


def save_case(path: str, layouts: list[Layout], mesh_shape: tuple[int, ...]) -> list[int]:
    """Save RaggedShard DTensors; every write item is a view of the local run (no gather) and
    the items are this rank's minimal boxes. Returns the number of items per tensor."""
    mesh = device_mesh(*mesh_shape)
    state = {f"t{i}": ragged_from_full(mesh, full_of(lay.seed, lay.shape), lay)
             for i, lay in enumerate(layouts)}
    counts = []
    for name, dt in state.items():
        items = dt.__create_write_items__(name, dt)
        local = dt.to_local()
        coordinate = mesh.get_local_rank(mesh.ndim - 1)
        start, end = dt.placements[-1].flat_range(dt.shape, coordinate)
        assert len(items) == len(flat_range_boxes(dt.shape, start, end))
        assert sum(math.prod(it.tensor_data.chunk.sizes) for it in items) == local.numel()
        for item in items:
            view = dt.__get_tensor_shard__(item.index)
            assert view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            assert tuple(view.shape) == tuple(item.tensor_data.chunk.sizes)
        counts.append(len(items))
    dcp.save(state, checkpoint_id=path)
    return counts


def load_case(path: str, layouts: list[Layout], mesh_shape: tuple[int, ...]) -> int:
    """Load into RaggedShard DTensors of other units, and into Replicate / Shard(0) DTensors."""
    mesh = device_mesh(*mesh_shape)
    ragged = {f"t{i}": ragged_from_full(mesh, torch.zeros(lay.shape), lay)
              for i, lay in enumerate(layouts)}
    dcp.load(ragged, checkpoint_id=path)
    checks = 0
    for i, lay in enumerate(layouts):
        expected_ragged(ragged[f"t{i}"], full_of(lay.seed, lay.shape), lay, f"load {lay}",
                        atol=0, rtol=0)
        checks += 1
    lead = (Replicate(),) * (mesh.ndim - 1)
    plain = {f"t{i}": torch_distribute_tensor(
        torch.zeros(lay.shape), mesh, lead + ((Shard(0),) if i % 2 else (Replicate(),)))
        for i, lay in enumerate(layouts)}
    dcp.load(plain, checkpoint_id=path)
    for i, lay in enumerate(layouts):
        assert torch.equal(plain[f"t{i}"].full_tensor(), full_of(lay.seed, lay.shape))
        checks += 1
    return checks


def test_dcp_save_at_4_load_at_3_and_2(ranks, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    saved = layouts_for(4, SHAPES, KS, seed=1)
    counts = ranks.run(4, save_case, path, saved, (4,))
    assert max(max(c) for c in counts) >= 2  # some rank's run needed several boxes
    for world, seed in ((3, 2), (2, 3)):
        # the same tensors (same seeds) under other units and world sizes
        other = [Layout(s.seed, s.shape, lay.k, lay.units)
                 for s, lay in zip(saved, layouts_for(world, SHAPES, KS_OTHER, seed))]
        assert ranks.run(world, load_case, path, other, (world,)) == [2 * len(SHAPES)] * world


def test_dcp_ragged_loads_checkpoint_of_other_placements(ranks, tmp_path) -> None:
    path = str(tmp_path / "plain")
    assert ranks.run(2, save_plain_case, path) == [None, None]
    layouts = layouts_for(3, SHAPES, KS, seed=4)
    assert ranks.run(3, load_ragged_only_case, path, layouts) == [len(SHAPES)] * 3


def save_plain_case(path: str) -> None:
    mesh = device_mesh(dist.get_world_size())
    state = {f"t{i}": torch_distribute_tensor(full_of(1000 + i, shape), mesh, [Shard(0)])
             for i, shape in enumerate(SHAPES)}
    dcp.save(state, checkpoint_id=path)


def load_ragged_only_case(path: str, layouts: list[Layout]) -> int:
    mesh = device_mesh(dist.get_world_size())
    state = {f"t{i}": ragged_from_full(mesh, torch.zeros(lay.shape), lay) for i, lay in enumerate(layouts)}
    dcp.load(state, checkpoint_id=path)
    for i, lay in enumerate(layouts):
        expected_ragged(state[f"t{i}"], full_of(lay.seed, lay.shape), lay, f"{lay}", atol=0, rtol=0)
    return len(layouts)


def test_dcp_hooks_unchanged_for_plain_dtensors(ranks) -> None:
    """torch's own hooks still answer for non-ragged DTensors."""
    assert ranks.run(2, plain_hooks_case) == [True, True]


def plain_hooks_case() -> bool:
    mesh = device_mesh(dist.get_world_size())
    dt = torch_distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    chunks = dt.__create_chunk_list__()
    shard = dt.__get_tensor_shard__(dt.__create_write_items__("x", dt)[0].index)
    return (len(chunks) == 1 and tuple(chunks[0].offsets) == (2 * dist.get_rank(), 0)
            and torch.equal(shard, dt.to_local()))
