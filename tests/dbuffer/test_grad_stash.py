"""DBuffer.stash_grad: accumulation without reduction keeps reduce_dtype precision.

bf16 gradients of several micro-batches are stashed into the fp32 stash and then reduced:
the result must equal the fp32 sum over micro-batches and ranks of the bf16 values (computed
here in fp64), not a sum rounded to bf16 after every micro-batch.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from dbuffer import DBuffer

from tests.dbuffer.cases import random_plan
from tests.harness import device_mesh

MICRO = 3


def _grads(plan, rank: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + micro)
    # values whose bf16 sums lose bits: 1 + small, so summing in bf16 rounds them away
    return {e.name: (1 + torch.rand(e.shape or (e.numel,), generator=g) / 64).bfloat16()
            for e in plan.entries}


def _stash_case(plan) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = DBuffer(plan, device_mesh(world), dtype=torch.float32, compute_dtype=torch.bfloat16,
                  reduce_dtype=torch.float32)
    errors = []
    for micro in range(MICRO):
        for name, grad in _grads(plan, rank, micro).items():
            buf.grad_view(name).add_(grad)
        if micro < MICRO - 1:
            buf.stash_grad()
            assert buf.has_grad_stash and not buf.has_grad
    buf.reduce_scatter("sum")
    assert not buf.has_grad_stash
    for name in buf.names:
        total = sum(_grads(plan, r, m)[name].double() for r in range(world) for m in range(MICRO))
        start, end = plan.local_range(name, rank)
        want = total.reshape(-1)[start:end].float()
        got = buf.sharded_grad_view(name)
        if not torch.equal(got, want):
            errors.append(f"{name}: max error {float((got - want).abs().max())}")
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_stashed_micro_batches_reduce_in_fp32(ranks, world_size: int) -> None:
    rng = random.Random(world_size)
    for _ in range(3):
        plan = random_plan(rng, world_size)
        assert ranks.run(world_size, _stash_case, plan) == [[]] * world_size
