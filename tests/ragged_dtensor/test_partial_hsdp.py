"""The HSDP gradient layout ``(Partial(), RaggedShard)`` (a gradient pending its sum over the
replicas): linear ops keep it with no communication; other ops and reductions reduce the
Partial mesh dim alone (one all-reduce, never a gather of the ragged dim); an in-place op that
would need the reduction is refused. Every result is checked against the summed full tensor."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.debug import CommDebugMode

from ragged_dtensor import RaggedShard
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import ragged_slice

UNITS = (1, 2)
SHAPE = (6, 4)

def _foreach_scaled(a: torch.Tensor) -> torch.Tensor:
    out = [a.clone()]
    torch._foreach_mul_(out, 3.0)
    return out[0]


def _foreach_added(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = [a.clone()]
    torch._foreach_add_(out, [b], alpha=2.0)
    return out[0]


#: ops linear in the pending tensors: the (Partial, RaggedShard) placement is kept, no collective
LINEAR = {
    "mul scalar": lambda a, b: a * 2.5,
    "div scalar": lambda a, b: a / 4,
    "neg": lambda a, b: -a,
    "add": lambda a, b: a + b,
    "sub alpha": lambda a, b: torch.sub(a, b, alpha=0.5),
    "clone": lambda a, b: a.clone(),
    "zero_": lambda a, b: a.clone().zero_(),
    "copy_": lambda a, b: a.clone().copy_(b),
    "mul_ scalar": lambda a, b: a.clone().mul_(0.1),
    "foreach mul_": lambda a, b: _foreach_scaled(a),
    "foreach add_ list": lambda a, b: _foreach_added(a, b),
}

#: other ops: computed on the summed values, (Replicate, RaggedShard) out
NON_LINEAR = {
    "add scalar": lambda a, b: a + 1,
    "mul of two": lambda a, b: a * b,
    "sqrt abs": lambda a, b: a.abs().sqrt(),
    "lerp": lambda a, b: torch.lerp(a, b, 0.3),
}

#: names CommDebugMode gives an all-reduce (c10d and functional)
ALL_REDUCE = {"allreduce_", "all_reduce"}

REDUCTIONS = {
    "sum": (lambda x: x.sum(), 0),
    "mean": (lambda x: x.mean(), 0),
    "norm2": (lambda x: torch.linalg.vector_norm(x), 1),
    "norm_inf": (lambda x: torch.linalg.vector_norm(x, math.inf), 1),
    "max": (lambda x: x.max(), 1),
    "min": (lambda x: x.min(), 1),
}


def _pending(parts: list[torch.Tensor], mesh, placement: RaggedShard) -> DTensor:
    row, col = mesh.get_local_rank(0), mesh.get_local_rank(1)
    local = ragged_slice(parts[row], 1, placement.local_units, col).clone()
    return DTensor.from_local(local, mesh, (Partial(), placement), shape=SHAPE,
                              stride=(SHAPE[1], 1), run_check=False)


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def partial_hsdp_cases() -> int:
    mesh = device_mesh(2, 2)
    placement = RaggedShard((0,), UNITS)
    col = mesh.get_local_rank(1)
    gen = torch.Generator().manual_seed(5)
    a_parts = [torch.randint(-9, 9, SHAPE, generator=gen).double() for _ in range(2)]
    b_parts = [torch.randint(-9, 9, SHAPE, generator=gen).double() for _ in range(2)]
    fa, fb = sum(a_parts), sum(b_parts)
    checks = 0
    for name, op in LINEAR.items():
        a, b = _pending(a_parts, mesh, placement), _pending(b_parts, mesh, placement)
        with CommDebugMode() as mode:
            out = op(a, b)
        assert mode.get_total_counts() == 0, (name, _counts(mode))
        assert out.placements == (Partial(), placement), (name, out.placements)
        torch.testing.assert_close(out.full_tensor(), op(fa, fb), msg=name)
        checks += 1
    for name, op in NON_LINEAR.items():
        a, b = _pending(a_parts, mesh, placement), _pending(b_parts, mesh, placement)
        with CommDebugMode() as mode:
            out = op(a, b)
        # one all-reduce per pending input on the replicate dim, nothing on the ragged dim
        assert set(_counts(mode)) <= ALL_REDUCE, (name, _counts(mode))
        assert out.placements == (Replicate(), placement), (name, out.placements)
        assert torch.equal(out.to_local(), ragged_slice(op(fa, fb), 1, UNITS, col)), name
        checks += 1
    for name, (op, collectives) in REDUCTIONS.items():
        a = _pending(a_parts, mesh, placement)
        with CommDebugMode() as mode:
            out = op(a)
        assert sum(_counts(mode).values()) == collectives, (name, _counts(mode))
        assert set(_counts(mode)) <= ALL_REDUCE, (name, _counts(mode))
        torch.testing.assert_close(out.full_tensor(), op(fa), msg=name)
        checks += 1
    # an in-place op that needs the summed values cannot run on the pending run: refused
    a = _pending(a_parts, mesh, placement)
    before = a.to_local().clone()
    with pytest.raises(RuntimeError, match="in place"):
        a.add_(1)
    assert torch.equal(a.to_local(), before)
    return checks + 1


def test_partial_ragged_layout_ops(ranks) -> None:
    expected = len(LINEAR) + len(NON_LINEAR) + len(REDUCTIONS) + 1
    assert ranks.run(4, partial_hsdp_cases) == [expected] * 4
