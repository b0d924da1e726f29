"""The HSDP layout (Replicate(), RaggedShard(...)) on a 2x2 mesh: construction, full_tensor and
redistribution to and from (Replicate(), Replicate()), Partial on either mesh dim, and the
clear error for layouts that mix RaggedShard with Shard on another mesh dim."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ragged_dtensor import RaggedShard, distribute_tensor
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import expected_local


def hsdp_cases(cases: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]) -> int:
    for shape, units, other in cases:
        hsdp_case(shape, units, other)
    return len(cases)


def hsdp_case(shape: tuple[int, ...], units: tuple[int, ...], other: tuple[int, ...]) -> None:
    mesh = device_mesh(2, 2)
    col = mesh.get_local_rank(1)
    row = mesh.get_local_rank(0)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64)
    ragged = RaggedShard((0,), units)
    hsdp = (Replicate(), ragged)

    def check(dt: DTensor, placements: tuple, want_full: torch.Tensor) -> None:
        assert dt.placements == placements
        want = want_full
        for p in placements:
            if not p.is_replicate():
                want = expected_local(want_full, p, 2, col)
        assert torch.equal(dt.to_local(), want), (placements, dt.to_local(), want)

    dt = distribute_tensor(full, mesh, hsdp)
    check(dt, hsdp, full)
    assert torch.equal(dt.full_tensor(), full)
    replicated = dt.redistribute(mesh, (Replicate(), Replicate()))
    check(replicated, (Replicate(), Replicate()), full)
    check(replicated.redistribute(mesh, hsdp), hsdp, full)
    for target in (RaggedShard((0,), other), Shard(0), Shard(full.ndim - 1)):
        moved = dt.redistribute(mesh, (Replicate(), target))
        check(moved, (Replicate(), target), full)
        check(moved.redistribute(mesh, hsdp), hsdp, full)
        assert torch.equal(moved.full_tensor(), full)

    # integer-valued parts: sums are exact in any order
    parts = [torch.randint(-50, 50, shape, generator=torch.Generator().manual_seed(7 + r)).double()
             for r in range(4)]
    rank = 2 * row + col
    # (Partial, RaggedShard): the ragged piece is pending a sum over the replicate dim
    mine = expected_local(parts[rank], ragged, 2, col)
    pending = DTensor.from_local(mine, mesh, (Partial(), ragged), shape=full.shape,
                                 stride=full.stride(), run_check=False)
    row_sum = parts[col] + parts[2 + col]
    check(pending.redistribute(mesh, hsdp), hsdp, row_sum)
    # (Replicate, Partial) -> (Replicate, RaggedShard) is a reduce-scatter on the shard dim
    # (replicated over dim 0: both rows hold row 0's parts)
    pending = DTensor.from_local(parts[col], mesh, (Replicate(), Partial()), run_check=False)
    check(pending.redistribute(mesh, hsdp), hsdp, parts[0] + parts[1])
    # (Partial, Partial) -> (Replicate, RaggedShard)
    pending = DTensor.from_local(parts[rank], mesh, (Partial(), Partial()), run_check=False)
    check(pending.redistribute(mesh, hsdp), hsdp, sum(parts))
    # beside a Shard, RaggedShard cuts the Shard-local tensor (ragged_dtensor.composed); an
    # odd dim 0 is cut as torch.chunk cuts it, and each row of the mesh (a TP coordinate) has
    # its own RaggedShard over its own TP-local rows
    tp_local = full.chunk(2)[row]
    beside = ragged if shape[0] % 2 == 0 else RaggedShard((0,), (1, tp_local.shape[0] - 1))
    start, end = beside.flat_range(tuple(tp_local.shape), col)
    composed = dt.redistribute(mesh, (Shard(0), beside))
    assert torch.equal(composed.to_local(), tp_local.reshape(-1)[start:end])
    assert torch.equal(composed.full_tensor(), full)
    assert torch.equal(composed.redistribute(mesh, hsdp).to_local(), dt.to_local())
    with pytest.raises(NotImplementedError, match="only one mesh dimension"):
        dt.redistribute(mesh, (ragged, ragged))


def test_hsdp_layout_on_a_2x2_mesh(ranks) -> None:
    cases = [((12, 5), (1, 2), (0, 1)), ((7,), (0, 1), (1, 0)), ((10, 3, 2), (3, 2), (2, 3))]
    assert ranks.run(4, hsdp_cases, cases) == [3] * 4
