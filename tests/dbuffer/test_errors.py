"""Errors raise on every rank (none is left waiting in a collective): a plan for another world
size, plans or dtypes that differ across ranks, unsupported dtypes, bad names."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dbuffer import DBuffer
from tests.dbuffer.cases import full_tensors, random_plan
from tests.dbuffer.collective_log import record_collectives


def _error_cases(plans: dict[str, object]) -> bool:
    rank = dist.get_rank()
    good, other_world, different = plans["good"], plans["other_world"], plans["different"]

    with pytest.raises(ValueError, match="plan is for world_size"):
        DBuffer(other_world)
    with pytest.raises(ValueError, match="differ across ranks.*DBuffer plan/dtype fingerprint"):
        DBuffer(different if rank == 0 else good)
    with pytest.raises(ValueError, match="differ across ranks.*DBuffer plan/dtype fingerprint"):
        DBuffer(good, compute_dtype=torch.bfloat16 if rank == 0 else None)
    with pytest.raises(TypeError, match="dtype: dtype torch.complex64 is not supported"):
        DBuffer(good, dtype=torch.complex64)
    with pytest.raises(TypeError, match="dtype: dtype torch.int32 holds no gradients"):
        DBuffer(good, dtype=torch.int32)
    with pytest.raises(TypeError, match="compute_dtype: dtype torch.bfloat16 is not supported "
                                        "for a cast from torch.int64"):
        DBuffer(good, dtype=torch.int64, compute_dtype=torch.bfloat16, requires_grad=())
    # A local error on one rank only: every rank raises, naming that rank; the happy path is
    # one small all-reduce (error flag and fingerprint), a failure adds one gather of messages.
    with record_collectives() as failing, \
            pytest.raises(TypeError, match="rank 1: TypeError: compute_dtype"):
        DBuffer(good, compute_dtype=torch.int32 if rank == 1 else None)
    with record_collectives() as happy:
        DBuffer(good)
    with record_collectives() as filled:
        DBuffer.from_tensors(full_tensors(good, 0), good)
    for log in (happy, filled):
        assert [(c.name, c.input_numel) for c in log] == [("all_reduce", 3)], log
    assert [c.name for c in failing] == ["all_reduce", "all_gather_object"], failing
    with pytest.raises(ValueError, match="requires_grad names tensors not in the plan"):
        DBuffer(good, requires_grad=["nope"])
    tensors = full_tensors(good, 0)
    if rank == 0:
        tensors.pop(next(iter(tensors)))
    with pytest.raises(ValueError, match="missing"):
        DBuffer.from_tensors(tensors, good)

    buf = DBuffer.from_tensors(full_tensors(good, 0), good)
    with pytest.raises(KeyError, match="not in this DBuffer"):
        buf.local_view("nope")
    with pytest.raises(ValueError, match="op must be"):
        buf.reduce_scatter("max")  # type: ignore[arg-type]
    # The group is still usable: every rank left every check at the same collective.
    buf.all_gather()
    return all(torch.equal(buf.unsharded_view(n), t) for n, t in full_tensors(good, 0).items())


def test_errors_raise_on_every_rank(ranks) -> None:
    rng = random.Random(3)
    good = random_plan(rng, 3)
    different = random_plan(rng, 3)
    while different.fingerprint() == good.fingerprint():
        different = random_plan(rng, 3)
    plans = {"good": good, "other_world": random_plan(rng, 2), "different": different}
    assert ranks.run(3, _error_cases, plans) == [True, True, True]
