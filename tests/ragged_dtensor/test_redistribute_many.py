"""redistribute_many moves a list of mixed-dtype tensors in ONE all_to_all_single, and the single
redistributions use exactly the collectives documented (counted with CommDebugMode, which sees
every c10d and functional collective dispatched)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from ragged_dtensor import RaggedShard, distribute_tensor, redistribute_many
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import expected_local


def collectives(mode: CommDebugMode) -> dict[str, int]:
    """Collective name -> count; ``alltoall_base_`` is the c10d op behind ``all_to_all_single``."""
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def many_case(specs: list[tuple[tuple[int, ...], torch.dtype, object, object]]) -> dict[str, int]:
    """Move every tensor with one call; compare each against the full tensor; count collectives."""
    mesh = device_mesh(dist.get_world_size())
    world, rank = dist.get_world_size(), dist.get_rank()
    fulls = [
        (torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape) * (i + 1)).to(dtype)
        for i, (shape, dtype, _, _) in enumerate(specs)
    ]
    sources = [
        DTensor.from_local(full * (rank + 1), mesh, [src], run_check=False) if src.is_partial()
        else distribute_tensor(full, mesh, [src])
        for full, (_, _, src, _) in zip(fulls, specs)
    ]
    partial_sum = world * (world + 1) // 2
    fulls = [full * partial_sum if src.is_partial() else full
             for full, (_, _, src, _) in zip(fulls, specs)]
    with CommDebugMode() as mode:
        moved = redistribute_many(sources, [[dst] for *_, dst in specs])
    for full, dt, (_, dtype, _, dst) in zip(fulls, moved, specs):
        want = expected_local(full, dst, world, rank)
        assert dt.placements == (dst,) and dt.dtype == dtype
        assert torch.equal(dt.to_local(), want), (dst, dt.to_local(), want)
        assert not dt.requires_grad
    return collectives(mode)


def random_specs(world: int, seed: int) -> list:
    rng = random.Random(seed)
    specs = []
    for _ in range(10):
        rows, cols = rng.choice([3, 5, 8, 12]) * world, rng.choice([1, 2, 7])
        def placement():
            kind = rng.choice(["ragged", "onehot", "shard0", "replicate"])
            if kind == "ragged":
                units = [rng.choice([0, 1, 2]) for _ in range(world)]
                units[rng.randrange(world)] += 1
                while rows % sum(units):
                    units[rng.randrange(world)] += 1
                return RaggedShard((0,), units)
            if kind == "onehot":
                owner = rng.randrange(world)
                return RaggedShard((0,), [int(r == owner) for r in range(world)])
            return Shard(0) if kind == "shard0" else Replicate()
        specs.append(((rows, cols), rng.choice([torch.float32, torch.bfloat16, torch.int32, torch.float64]),
                      placement(), placement()))
    return specs


def single_counts_case() -> dict[str, dict[str, int]]:
    """Collectives of each single redistribution on a 4-rank mesh."""
    mesh = device_mesh(dist.get_world_size())
    full = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    ragged = distribute_tensor(full, mesh, [RaggedShard((0,), (3, 0, 2, 1))])
    counts = {}
    targets = {
        "ragged": RaggedShard((0,), (1, 1, 1, 1)),
        "one_hot": RaggedShard((0,), (0, 0, 1, 0)),
        "shard0": Shard(0),
        "shard1": Shard(1),
        "replicate": Replicate(),
    }
    for name, target in targets.items():
        with CommDebugMode() as mode:
            ragged.redistribute(mesh, [target])
        counts[f"ragged->{name}"] = collectives(mode)
    replicated = distribute_tensor(full, mesh, [Replicate()])
    with CommDebugMode() as mode:
        replicated.redistribute(mesh, [ragged.placements[0]])
    counts["replicate->ragged"] = collectives(mode)
    shard1 = distribute_tensor(full, mesh, [Shard(1)])
    with CommDebugMode() as mode:
        shard1.redistribute(mesh, [ragged.placements[0]])
    counts["shard1->ragged"] = collectives(mode)
    partial = DTensor.from_local(full, mesh, [Partial()], run_check=False)
    with CommDebugMode() as mode:
        partial.redistribute(mesh, [ragged.placements[0]])
    counts["partial->ragged"] = collectives(mode)
    # backward of RaggedShard -> Replicate is a local slice
    leaf = ragged.to_local().detach().requires_grad_()
    dt = DTensor.from_local(leaf, mesh, ragged.placements, shape=full.shape, stride=full.stride(),
                            run_check=False)
    out = dt.full_tensor()
    with CommDebugMode() as mode:
        out.sum().backward()
    counts["backward of ragged->replicate"] = collectives(mode)
    return counts


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_redistribute_many_is_one_all_to_all(ranks, world: int) -> None:
    counts = ranks.run(world, many_case, random_specs(world, seed=world))
    assert all(c == {"alltoall_base_": 1} for c in counts), counts


def test_redistribute_many_beyond_the_contract(ranks) -> None:
    """Partial sources (reduced on arrival) and strided Shard(1) pieces in the same call."""
    ragged = RaggedShard((0,), (0, 2, 1))
    specs = [
        ((6, 5), torch.float64, Partial("sum"), ragged),
        ((6, 5), torch.int64, Partial("sum"), Shard(1)),
        ((6, 5), torch.float32, Partial("sum"), Replicate()),
        ((6, 5), torch.float32, Shard(1), Replicate()),
        ((6, 5), torch.float32, Shard(1), ragged),
        ((6, 5), torch.bfloat16, ragged, Shard(1)),
    ]
    counts = ranks.run(3, many_case, specs)
    assert all(c == {"alltoall_base_": 1} for c in counts), counts


def test_single_redistributions_use_the_documented_collectives(ranks) -> None:
    counts = ranks.run(4, single_counts_case)[0]
    one_a2a = {"alltoall_base_": 1}
    assert counts["ragged->ragged"] == one_a2a
    assert counts["ragged->one_hot"] == one_a2a
    assert counts["ragged->shard0"] == one_a2a
    assert counts["ragged->shard1"] == one_a2a
    assert counts["shard1->ragged"] == one_a2a
    assert counts["partial->ragged"] == one_a2a
    assert counts["replicate->ragged"] == {}
    assert counts["backward of ragged->replicate"] == {}
    assert sum(counts["ragged->replicate"].values()) == 1, counts



def _align16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def shard_to_ragged_bytes_case(shape: tuple[int, ...], cases: list) -> list[tuple[int, int]]:
    """Shard(d) -> RaggedShard moves only the elements that change owner: the bytes received
    from every other rank (less its 16-byte status header, pieces 16-byte aligned) equal the
    elements that rank holds under Shard(d) and this rank holds under RaggedShard, counted by
    brute force over element indices."""
    mesh = device_mesh(dist.get_world_size())
    world, rank = dist.get_world_size(), dist.get_rank()
    ids = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    seen: list[list[int]] = []
    original = dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        seen.append(list(output_split_sizes))
        return original(output, input, output_split_sizes, input_split_sizes, **kwargs)

    results = []
    for dim, units in cases:
        target = RaggedShard((0,), units)
        source = distribute_tensor(ids, mesh, [Shard(dim)])
        seen.clear()
        dist.all_to_all_single = recording
        try:
            moved = source.redistribute(mesh, [target])
        finally:
            dist.all_to_all_single = original
        assert torch.equal(moved.to_local(), expected_local(ids, target, world, rank))
        assert len(seen) == 1, seen
        mine = set(expected_local(ids, target, world, rank).long().tolist())
        for p in range(world):
            if p == rank:
                continue
            theirs = set(expected_local(ids, Shard(dim), world, p).reshape(-1).long().tolist())
            results.append((seen[0][p] - 16, _align16(4 * len(mine & theirs))))
    return results


def test_shard_to_ragged_moves_only_elements_that_change_owner(ranks) -> None:
    shape = (8, 6, 5)
    cases = [(0, (1, 0, 2, 1)), (1, (1, 0, 2, 1)), (2, (0, 0, 1, 0)), (1, (2, 2, 2, 2))]
    for per_rank in ranks.run(4, shard_to_ragged_bytes_case, shape, cases):
        for got, want in per_rank:
            assert got == want
