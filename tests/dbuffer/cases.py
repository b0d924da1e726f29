"""Random plans and deterministic tensors shared by the dbuffer tests.

Cases are drawn in the pytest parent (seeded) and passed to every rank; tensors are rebuilt
from seeds on each rank, so every rank can compute the single-device reference itself.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from layout_planner import Plan, TensorSpec, plan


@dataclass(frozen=True)
class Case:
    """One buffer configuration: a plan plus dtypes and a data seed."""

    plan: Plan
    seed: int
    dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    async_op: bool = False

    @property
    def kwargs(self) -> dict[str, object]:
        return {"dtype": self.dtype, "compute_dtype": self.compute_dtype,
                "reduce_dtype": self.reduce_dtype}


def random_specs(rng: random.Random, count: int) -> list[TensorSpec]:
    """Matrices and vectors with row-block, element or whole-tensor units."""
    specs = []
    for i in range(count):
        if rng.random() < 0.7:
            rows, cols = rng.randint(1, 24), rng.randint(1, 12)
            shape: tuple[int, ...] = (rows, cols)
            unit = rng.choice([1, cols, cols * rng.randint(1, 4), rows * cols])
        else:
            shape = (rng.randint(1, 40),)
            unit = rng.choice([1, 1, 8, shape[0]])
        specs.append(TensorSpec(f"t{i}", math.prod(shape), unit, shape))
    return specs


def random_plan(rng: random.Random, world_size: int) -> Plan:
    return plan(random_specs(rng, rng.randint(1, 6)), world_size, align=rng.choice([1, 4]))


def full_tensors(p: Plan, seed: int) -> dict[str, torch.Tensor]:
    """Parameters: dyadic values exactly representable in bf16."""
    g = torch.Generator().manual_seed(seed)
    return {e.name: torch.randint(-64, 64, e.shape or (e.numel,), generator=g).float() / 8
            for e in p.entries}


def rank_grads(p: Plan, seed: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s gradients: small dyadic values, so sums are exact in any order."""
    g = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    return {e.name: torch.randint(-32, 32, e.shape or (e.numel,), generator=g).float() / 4
            for e in p.entries}


def grad_sum(p: Plan, seed: int, ranks: int) -> dict[str, torch.Tensor]:
    """The single-device reference: the sum of every rank's gradients."""
    grads = [rank_grads(p, seed, r) for r in range(ranks)]
    return {e.name: torch.stack([g[e.name] for g in grads]).sum(0) for e in p.entries}


def local_piece(p: Plan, name: str, rank: int, full: torch.Tensor) -> torch.Tensor:
    start, end = p.local_range(name, rank)
    return full.reshape(-1)[start:end]
