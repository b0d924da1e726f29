"""``DTensor.from_local`` with a RaggedShard placement checks the local run: 1-D, contiguous,
``local_numel`` elements, global shape given. With ``run_check=True`` every rank raises when
any rank's run is wrong (consensus); with ``run_check=False`` only the failing rank raises (no
communication). A redistribution that moves nothing still raises a wrong size on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.debug import CommDebugMode

from ragged_dtensor import RaggedShard
from ragged_dtensor.redistribute import redistribute_ragged_local_tensor
from tests.harness import device_mesh

BAD_LOCALS = ("too_long", "non_contiguous", "two_dims", "no_shape")


def _local(kind: str, good: torch.Tensor) -> torch.Tensor:
    if kind == "too_long":
        return torch.ones(good.numel() + 1)
    if kind == "non_contiguous":
        return torch.ones(2 * good.numel())[::2]
    if kind == "two_dims":
        return good.view(1, -1)
    return good


def from_local_cases(bad_rank: int) -> list[str]:
    mesh = device_mesh(dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    placement = RaggedShard((0,), [2] * world)
    shape, stride = (2 * world, 3), (3, 1)
    good = torch.arange(6.0) + 6 * rank
    messages = []
    for kind in BAD_LOCALS:
        local = _local(kind, good) if rank == bad_rank else good
        kwargs = {} if kind == "no_shape" else {"shape": shape, "stride": stride}
        # consensus: every rank raises, naming the failing rank
        with pytest.raises(ValueError) as info:
            DTensor.from_local(local, mesh, [placement], run_check=True, **kwargs)
        assert f"rank {bad_rank}" in str(info.value), kind
        messages.append(str(info.value))
        # no communication: only the failing rank raises
        with CommDebugMode() as mode:
            if rank == bad_rank or kind == "no_shape":
                with pytest.raises(ValueError, match=f"rank {rank}"):
                    DTensor.from_local(local, mesh, [placement], run_check=False, **kwargs)
            else:
                dt = DTensor.from_local(local, mesh, [placement], run_check=False, **kwargs)
                assert torch.equal(dt.to_local(), good)
        assert mode.get_total_counts() == 0
    # the right run passes both ways and gives the right tensor
    for run_check in (True, False):
        dt = DTensor.from_local(good, mesh, [placement], shape=shape, stride=stride,
                                run_check=run_check)
        assert torch.equal(dt.full_tensor(), torch.arange(6.0 * world).view(shape))
    return messages


@pytest.mark.parametrize("world", [1, 3])
def test_from_local_checks_the_ragged_run(ranks, world: int) -> None:
    bad_rank = world - 1
    results = ranks.run(world, from_local_cases, bad_rank)
    for messages in results:
        assert "has shape (7,)" in messages[0] and "run of 6 elements" in messages[0]
        assert "not contiguous" in messages[1]
        assert "has shape (1, 6)" in messages[2]
        assert "needs the global shape" in messages[3]
    assert all(r == results[0] for r in results)


def nothing_moves_case() -> str:
    """RaggedShard -> Partial moves nothing; a wrong-sized run (built without from_local's
    check) still raises on every rank instead of on the bad rank alone."""
    mesh = device_mesh(dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    placement = RaggedShard((0,), [1] * world)
    meta = TensorMeta(torch.Size((3 * world,)), (1,), torch.float32)
    local = torch.ones(3 + (rank == world - 1))
    spec = DTensorSpec(mesh, (placement,), tensor_meta=meta)
    with pytest.raises(ValueError) as info:
        # the redistribution an op's propagation may plan (DTensor.redistribute refuses Partial)
        redistribute_ragged_local_tensor(local, spec, DTensorSpec(mesh, (Partial(),), tensor_meta=meta))
    return str(info.value)


def test_wrong_size_raises_on_every_rank_when_nothing_moves(ranks) -> None:
    for message in ranks.run(3, nothing_moves_case):
        assert "on rank 2 has 4 elements" in message and "gives that rank 3" in message
