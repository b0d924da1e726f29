"""Muon on sharded parameters (1-4 gloo ranks) against the single-device optimizer."""

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
    unsynced_non_finite_case,
)

SHAPES = {
    "wq": (24, 16), "w_tall": (40, 12), "experts_whole": (6, 10, 8), "experts_cut": (5, 6, 4),
    "bias": (16,), "w_shard0": (18, 10), "w_rep": (10, 14), "w_shard1": (12, 9), "emb": (20, 8),
}


def composition(rng: random.Random, n: int, world: int) -> tuple[int, ...]:
    """``n`` split into ``world`` non-negative parts, zeros likely (uneven, zero-unit ranks)."""
    cuts = sorted(rng.randint(0, n) for _ in range(world - 1))
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    return tuple(parts)


def draw_layouts(world: int, seed: int) -> dict[str, tuple]:
    rng = random.Random(seed)
    return {
        "wq": ("ragged", 1, composition(rng, 24, world)),
        "w_tall": ("ragged", 2, composition(rng, 40 * 12, world)),
        "experts_whole": ("ragged", 1, composition(rng, 6, world)),
        "experts_cut": ("ragged", 2, composition(rng, 30, world)),
        "bias": ("ragged", 1, composition(rng, 16, world)),
        "w_shard0": ("shard", 0),
        "w_rep": ("replicate",),
        "w_shard1": ("shard", 1),
        "emb": ("ragged", 1, composition(rng, 20, world)),
    }


def draw(seed: int, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES.values()]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES.values()] for _ in range(steps)]
    return fulls, grads


NAMES = list(SHAPES)
GROUPS = [{"params": list(range(8))}, {"params": [8], "use_muon": False}]
KWARGS = {"lr": 0.05, "weight_decay": 0.1, "ns_dtype": torch.float32, "adamw_lr": 0.01}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_equals_single_device_bitwise(ranks, world: int) -> None:
    # Three random layouts per world size (uneven, zero-unit ranks), one round trip.
    draws = [(draw(10 * world + k, 5), draw_layouts(world, 100 * world + k)) for k in range(3)]
    cases = [(ShardedRun("Muon", world, NAMES, fulls, list(layouts.values()), KWARGS, GROUPS), grads)
             for (fulls, grads), layouts in draws]
    results = ranks.run(world, step_sharded_many, cases)
    for k, ((fulls, grads), layouts) in enumerate(draws):
        expected = step_single("Muon", NAMES, fulls, grads, KWARGS, GROUPS)
        for i, name in enumerate(NAMES):
            got = assemble([r[k]["locals"][i] for r in results], SHAPES[name], layouts[name])
            assert torch.equal(got, expected[i]), (k, name, layouts[name])
    if world > 1:
        warned = [w for w in results[0][0]["warnings"] if "'w_shard1'" in w]
        assert len(warned) == 1  # once per parameter, not per step


def test_collectives_per_step(ranks) -> None:
    world = 3
    fulls, grads = draw(7, 2)
    layouts = draw_layouts(world, 7)
    layouts["wq"] = ("ragged", 1, (8, 8, 8))
    layouts["experts_whole"] = ("ragged", 1, (2, 2, 2))
    # Every flat-readable placement (cut, whole, Shard(0), Replicate, a use_muon=False group):
    # one all-to-all each way and nothing else, seen by both counters.
    keep = [i for i, name in enumerate(NAMES) if name != "w_shard1"]
    groups = [{"params": list(range(len(keep) - 1))}, {"params": [len(keep) - 1], "use_muon": False}]
    assert NAMES[keep[-1]] == "emb"
    run = ShardedRun("Muon", world, [NAMES[i] for i in keep], [fulls[i] for i in keep],
                     [layouts[NAMES[i]] for i in keep], KWARGS, groups)
    results = ranks.run(world, step_sharded, run, [[g[i] for i in keep] for g in grads])
    for counts in results[0]["counts"]:
        assert counts["calls"] == {"all_to_all_single": 2}, counts
        assert counts["comm"] == {"c10d.alltoall_base_": 2}, counts
    # Shard(1) is not flat-contiguous: the update is gathered with DTensor's functional
    # all-gather (invisible to a torch.distributed wrapper), then, replicated, its result
    # comes back in the return all-to-all; with a cut matrix beside it, both all-to-alls run.
    pair = [NAMES.index("w_shard1"), NAMES.index("wq")]
    run = ShardedRun("Muon", world, [NAMES[i] for i in pair], [fulls[i] for i in pair],
                     [layouts[NAMES[i]] for i in pair], KWARGS)
    results = ranks.run(world, step_sharded, run, [[g[i] for i in pair] for g in grads])
    for counts in results[0]["counts"]:
        assert counts["calls"] == {"all_to_all_single": 2}, counts
        assert counts["comm"] == {"c10d.alltoall_base_": 2, "c10d_functional.all_gather_into_tensor": 1}, counts
    # Only 3-D stacks, every expert whole on one rank (one rank holds none): no all-to-all;
    # by default one small flag all-reduce agrees on the non-finite check, and with
    # sync_nonfinite_check=False nothing at all is issued.
    stacks = {"a": (6, 10, 8), "b": (3, 4, 4)}
    stack_layouts = [("ragged", 1, (4, 0, 2)), ("ragged", 1, (1, 1, 1))]
    gen = torch.Generator().manual_seed(0)
    stack_fulls = [torch.randn(s, generator=gen) for s in stacks.values()]
    stack_grads = [[torch.randn(s, generator=gen) for s in stacks.values()] for _ in range(2)]
    expected = step_single("Muon", list(stacks), stack_fulls, stack_grads, KWARGS)
    unsynced = {**KWARGS, "sync_nonfinite_check": False}
    results = ranks.run(world, step_sharded_many, [
        (ShardedRun("Muon", world, list(stacks), stack_fulls, stack_layouts, KWARGS), stack_grads),
        (ShardedRun("Muon", world, list(stacks), stack_fulls, stack_layouts, unsynced), stack_grads),
    ])
    flag = ranks.run(world, consensus_flag_numel)[0]
    for counts in results[0][0]["counts"]:
        assert counts["calls"] == {"all_reduce": 1} and counts["numels"] == {"all_reduce": [flag]}, counts
        assert counts["comm"] == {"c10d.allreduce_": 1}, counts
    for counts in results[0][1]["counts"]:
        assert counts == {"calls": {}, "numels": {}, "comm": {}}, counts
    for k in range(2):
        for i, name in enumerate(stacks):
            got = assemble([r[k]["locals"][i] for r in results], stacks[name], stack_layouts[i])
            assert torch.equal(got, expected[i]), (k, name)
        assert results[0][k]["warnings"] == []


def test_unsynced_non_finite_check_raises_on_the_finding_rank_only(ranks) -> None:
    results = ranks.run(3, unsynced_non_finite_case, 3, ("ragged", 1, (2, 0, 4)), 2)
    assert [r["message"] is None for r in results] == [True, True, False]
    assert "Newton-Schulz input of parameter 'experts'" in results[2]["message"]
    for r in results:
        assert all(c == {"calls": {}, "numels": {}, "comm": {}} for c in r["counts"]), r["counts"]


@pytest.mark.parametrize(
    ("layout", "bad_rank"),
    [(("ragged", 2, (10, 7, 7)), 1),   # cut experts: the status rides in the return all-to-all
     (("ragged", 1, (2, 0, 4)), 2)],   # whole experts: no all-to-all, consensus flag
)
def test_non_finite_is_raised_on_every_rank(ranks, layout: tuple, bad_rank: int) -> None:
    messages = ranks.run(3, non_finite_case, 3, layout, bad_rank, "Muon")
    assert all("Newton-Schulz input of parameter 'experts'" in m for m in messages)


def test_checkpoint_reloads_under_another_world_size(ranks, tmp_path) -> None:
    names = ["wq", "experts", "bias"]
    shapes = [(12, 8), (4, 6, 5), (8,)]
    gen = torch.Generator().manual_seed(11)
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    kwargs = {"lr": 0.05, "ns_dtype": torch.float32}
    save_layouts = [("ragged", 1, (5, 0, 4, 3)), ("ragged", 2, (7, 9, 8, 0)), ("shard", 0)]
    load_layouts = [("ragged", 1, (2, 10)), ("ragged", 1, (3, 1)), ("ragged", 1, (0, 8))]
    ranks.run(4, checkpoint_case, ShardedRun("Muon", 4, names, fulls, save_layouts, kwargs), str(tmp_path), True,
              grads[:3])
    results = ranks.run(2, checkpoint_case, ShardedRun("Muon", 2, names, fulls, load_layouts, kwargs), str(tmp_path),
                        False, grads[3:])
    expected = step_single("Muon", names, fulls, grads, kwargs)
    for i, shape in enumerate(shapes):
        got = assemble([r[i] for r in results], shape, load_layouts[i])
        assert torch.equal(got, expected[i]), names[i]
