"""raise_on_any_rank: one rank's error is raised on every rank, naming the rank; and a RaggedShard
DTensor with a wrong local size fails on every rank inside the redistribution's own collective
instead of leaving the other ranks waiting."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_dtensor import RaggedShard, raise_on_any_rank, raise_on_any_rank_along, redistribute_many
from tests.dbuffer.collective_log import record_collectives
from tests.harness import device_mesh


class CustomError(ValueError):
    pass


def consensus_case(failing: list[int]) -> list[str]:
    rank = dist.get_rank()
    messages = []
    raise_on_any_rank(None)  # the happy path returns on every rank
    error = CustomError(f"bad input on {rank}") if rank in failing else None
    with pytest.raises(CustomError) as info:
        raise_on_any_rank(error)
    messages.append(str(info.value))
    if rank in failing:
        assert info.value.__cause__ is error
    # an exception type that cannot be built from a message falls back to RuntimeError
    error = UnicodeDecodeError("utf-8", b"x", 0, 1, "boom") if rank == failing[0] else None
    with pytest.raises(RuntimeError, match="boom"):
        raise_on_any_rank(error)
    return messages


def agree_case(odd: int) -> str:
    rank = dist.get_rank()
    with record_collectives() as log:
        raise_on_any_rank(None, agree_on="plan A")  # equal values: the happy path returns
    assert [(c.name, c.input_numel) for c in log] == [("all_reduce", 3)], log
    with pytest.raises(ValueError, match="differ across ranks") as info:
        raise_on_any_rank(None, agree_on="plan B" if rank == odd else "plan A")
    # an error wins over a disagreement, and is raised with its own type
    with pytest.raises(CustomError, match="rank 0: CustomError: first"):
        raise_on_any_rank(CustomError("first") if rank == 0 else None, agree_on=str(rank))
    return str(info.value)


def wrong_size_case(mode: str) -> str:
    mesh = device_mesh(dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    placement = RaggedShard((0,), [1] * world)
    numel = 3 + (rank == world - 1)  # the last rank holds one element too many
    # from_local refuses a wrong-sized run, so build the broken DTensor directly: the
    # redistribution must still catch it on every rank
    dt = DTensor(torch.ones(numel), DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(
        torch.Size((world * 3,)), (1,), torch.float32)), requires_grad=False)
    with pytest.raises(ValueError) as info:
        if mode == "full_tensor":
            dt.full_tensor()
        elif mode == "ragged":
            dt.redistribute(mesh, [RaggedShard((0,), [world] + [0] * (world - 1))])
        else:
            good = DTensor.from_local(torch.ones(2), mesh, [placement], shape=(world * 2,),
                                      stride=(1,), run_check=False)
            redistribute_many([good, dt], [[Replicate()], [Replicate()]])
    return str(info.value)


@pytest.mark.parametrize("world", [1, 3])
def test_raise_on_any_rank_raises_everywhere(ranks, world: int) -> None:
    failing = [0] if world == 1 else [1, 2]
    results = ranks.run(world, consensus_case, failing)
    for messages in results:
        for r in failing:
            assert f"rank {r}: CustomError: bad input on {r}" in messages[0]
    assert len(set(m[0] for m in results)) == 1


def test_raise_on_any_rank_checks_agreement_in_the_same_collective(ranks) -> None:
    messages = ranks.run(3, agree_case, 1)
    assert len(set(messages)) == 1
    assert "rank 0: plan A; rank 1: plan B; rank 2: plan A" in messages[0]


def test_raise_on_any_rank_without_process_group() -> None:
    raise_on_any_rank(None)
    with pytest.raises(KeyError):
        raise_on_any_rank(KeyError("x"))


@pytest.mark.parametrize("mode", ["full_tensor", "ragged", "many"])
def test_wrong_local_size_fails_on_every_rank(ranks, mode: str) -> None:
    messages = ranks.run(3, wrong_size_case, mode)
    for message in messages:
        assert "on rank 2 has 4 elements" in message and "gives that rank 3" in message


def along_case() -> dict[str, object]:
    """Rank 1's error on a 2 x 2 mesh ([[0, 1], [2, 3]]): along both dims it reaches rank 2,
    which shares no group with rank 1; along one dim it does not."""
    rank = dist.get_rank()
    mesh = device_mesh(2, 2, names=("rows_c", "cols_c"))
    steps = [(mesh.get_group(0), None), (mesh.get_group(1), None)]
    out: dict[str, object] = {}
    with record_collectives() as happy:
        raise_on_any_rank_along(None, steps)
    out["happy"] = [c.name for c in happy]
    problem = CustomError("bad on 1") if rank == 1 else None
    try:
        raise_on_any_rank_along(problem, steps)
        out["along"] = "no error"
    except CustomError as error:
        out["along"] = str(error)
    try:
        raise_on_any_rank(problem, mesh.get_group(1))
        out["one_dim"] = "no error"
    except CustomError as error:
        out["one_dim"] = str(error)
    # agree_on is checked within its own step's group: the rows differ, each row agrees
    row = mesh.get_local_rank(0)
    raise_on_any_rank_along(None, [(mesh.get_group(0), None),
                                   (mesh.get_group(1), f"row {row}")])
    return out


def test_raise_on_any_rank_along_reaches_every_rank_of_a_mesh(ranks) -> None:
    outs = ranks.run(4, along_case)
    for rank, out in enumerate(outs):
        assert out["happy"] == ["all_reduce", "all_reduce"], out  # one per step when all is well
        # the failing rank only, not the ranks that relayed its error
        assert out["along"] == "error on 1 rank(s): rank 1: CustomError: bad on 1", (rank, out)
    # one dim alone reaches only rank 1's row ({0, 1}): ranks 2 and 3 would go on
    assert [o["one_dim"] != "no error" for o in outs] == [True, True, False, False]


def local_type_case() -> str:
    """An exception class defined inside a function cannot be pickled: the failing rank sends
    its nearest picklable base instead of failing in the collective alone (which left the
    other ranks waiting)."""
    class LocalError(ValueError):
        pass

    error = LocalError("bad on 2") if dist.get_rank() == 2 else None
    try:
        raise_on_any_rank(error)
    except ValueError as caught:
        return f"{type(caught).__name__}: {caught}"
    return "no error"


def test_an_unpicklable_error_type_raises_its_base_everywhere(ranks) -> None:
    for message in ranks.run(3, local_type_case, timeout=60):
        assert message == "ValueError: error on 1 rank(s): rank 2: LocalError: bad on 2", message
