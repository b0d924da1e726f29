"""Gradients reach the reduce-scatter however autograd delivers them, against the single-device
sum of every rank's gradients: first-order accumulation in place, ``create_graph=True`` (which
replaces ``.grad``), a user-assigned ``.grad``, a backward after ``free_grad()``, and explicit
``fold_grad`` for parameters DBuffer did not hand out. Also: an empty buffer re-gathers, the
pre-division scales the gradient buffer in place, ``free_grad=True`` releases the gradient
buffer as early as the collective allows, and the collectives raise no deprecation
warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from layout_planner import Plan, plan

from dbuffer import DBuffer
from tests.dbuffer.cases import Case, full_tensors, local_piece, rank_grads
from tests.dbuffer.collective_log import record_collectives
from tests.dbuffer.test_freed_dtensors import zero_unit_plan


def _params(buf: DBuffer) -> dict[str, torch.Tensor]:
    """The unsharded views themselves as parameters, each ``.grad`` the gradient view."""
    params = {n: buf.unsharded_view(n).requires_grad_() for n in buf.names}
    for n, param in params.items():
        param.grad = buf.grad_view(n)
    return params


def _backward(params: dict[str, torch.Tensor], coeffs: dict[str, torch.Tensor], **kwargs) -> None:
    """d(loss)/d(param) = coeffs (in the param's dtype)."""
    loss = sum((p * coeffs[n].to(p.dtype)).sum() for n, p in params.items())
    loss.backward(**kwargs)


def _expected(p: Plan, seeds: list[int], rank: int) -> dict[str, torch.Tensor]:
    """This rank's piece of the sum over ranks and seeds of every rank's gradients."""
    world = dist.get_world_size()
    total = {e.name: sum(rank_grads(p, s, r)[e.name] for s in seeds for r in range(world))
             for e in p.entries}
    return {n: local_piece(p, n, rank, t) for n, t in total.items()}


def _check(buf: DBuffer, p: Plan, seeds: list[int]) -> None:
    buf.free_sharded_grad()
    buf.reduce_scatter("sum")
    for n, expected in _expected(p, seeds, buf.rank).items():
        got = buf.sharded_grad_view(n)
        assert torch.equal(got, expected.to(got.dtype)), (n, got, expected)


def _gradient_path_case(case: Case) -> bool:
    p, rank = case.plan, dist.get_rank()
    buf = DBuffer.from_tensors(full_tensors(p, 0), p, **case.kwargs)
    buf.all_gather()
    params = _params(buf)
    coeffs = [rank_grads(p, s, rank) for s in range(3)]

    # create_graph=True replaces .grad by .grad + new: a first-order pass, then two such
    # passes, are all in the reduced gradient (none lost, none counted twice)
    _backward(params, coeffs[0])
    _backward(params, coeffs[1], create_graph=True)
    _backward(params, coeffs[2], create_graph=True)
    _check(buf, p, [0, 1, 2])
    assert all(buf.grad_is_view(n, param.grad) for n, param in params.items())

    # a backward after free_grad() (before any grad_view()) starts from zero
    buf.free_grad()
    assert all(param.grad is None for param in params.values())
    _backward(params, coeffs[1])
    _check(buf, p, [1])

    # a user-assigned .grad is the parameter's gradient
    for n, param in params.items():
        param.grad = rank_grads(p, 2, rank)[n].to(param.dtype)
    _check(buf, p, [2])

    # fold_grad for parameters DBuffer did not hand out (their .grad starts as None)
    buf.free_grad()
    aliases = {n: buf.unsharded_view(n).detach().requires_grad_() for n in buf.names}
    for coeff in coeffs[:2]:
        _backward(aliases, coeff, create_graph=True)
        for n, alias in aliases.items():
            buf.fold_grad(n, alias.grad)  # fp32 into the compute dtype, added
            buf.fold_grad(n, buf.grad_view(n))  # already in the buffer: a no-op
            alias.grad = None
    _check(buf, p, [0, 1])
    for n in buf.names:  # the hook pattern of fsdp: a replacement of the view is copied
        alias = aliases[n]
        alias.grad = buf.grad_view(n)
        _backward({n: alias}, coeffs[2], create_graph=True)
        assert not buf.grad_is_view(n, alias.grad)
        buf.fold_grad(n, alias.grad, includes_view=True)
    _check(buf, p, [0, 1, 2])
    # a sparse gradient (nn.Embedding(sparse=True)) is never the view, and asking reads no
    # storage (a sparse tensor has none)
    for n in buf.names:
        view = buf.grad_view(n)
        assert not buf.grad_is_view(n, torch.zeros_like(view).to_sparse())
    name = p.entries[0].name
    with pytest.raises(ValueError, match=f"fold_grad\\('{name}'\\): gradient of shape"):
        buf.fold_grad(name, torch.zeros(7, 7))
    buf.free_grad()
    buf.free_unsharded()
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_gradients_reach_the_reduce_scatter_in_every_autograd_mode(ranks, world_size: int) -> None:
    p = zero_unit_plan(world_size)
    cases = [Case(p, seed=0), Case(p, seed=0, compute_dtype=torch.bfloat16,
                                   reduce_dtype=torch.float32)]
    for case in cases:
        assert ranks.run(world_size, _gradient_path_case, case) == [True] * world_size


def _empty_case() -> bool:
    buf = DBuffer(plan([], dist.get_world_size()))
    for _ in range(3):
        buf.all_gather()
        assert buf.is_unsharded and buf.unsharded_buffer.numel() == 0
        buf.free_unsharded()
        assert not buf.is_unsharded
    buf.all_gather(async_op=True).wait()
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_empty_buffer_gathers_again_after_free(ranks, world_size: int) -> None:
    assert ranks.run(world_size, _empty_case) == [True] * world_size


def _predivide_and_warnings_case(case: Case) -> None:
    p, rank = case.plan, dist.get_rank()
    buf = DBuffer.from_tensors(full_tensors(p, 0), p)
    for n in buf.names:
        buf.grad_view(n).copy_(rank_grads(p, 0, rank)[n])
    with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
        warnings.simplefilter("always")
        buf.all_gather()
        buf.reduce_scatter("avg", predivide=True)
        buf.all_gather(async_op=True).wait()
        buf.reduce_scatter("avg", predivide=True, async_op=True).wait()
    # no dtype change: the collective reads the gradient buffer itself, scaled in place
    rs = [c for c in log if c.name.startswith("reduce_scatter")]
    assert len(rs) == 2 and all(c.input == buf.grad_buffer.data_ptr() for c in rs), log
    assert [c.name for c in log] == ["all_gather_single", "reduce_scatter_single"] * 2, log
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))], \
        [str(w.message) for w in caught]
    world = dist.get_world_size()
    expected = _expected(p, [0], rank)
    for n in buf.names:  # avg of the first pass, plus avg of the pre-divided buffer again
        first = expected[n] / world
        torch.testing.assert_close(buf.sharded_grad_view(n), first + first / world)


@pytest.mark.parametrize("world_size", (2, 3))
def test_predivide_scales_in_place_with_single_collectives(ranks, world_size: int) -> None:
    ranks.run(world_size, _predivide_and_warnings_case, Case(zero_unit_plan(world_size), 0))


def _free_grad_early_case(p: Plan) -> dict[str, list[bool]]:
    """``reduce_scatter(free_grad=True)``: with a wider reduce dtype the gradient buffer is
    released as soon as it is cast (before the collective completes), else when the collective
    completes; the reduced values are those of the ordinary call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    held: dict[str, list[bool]] = {}
    for label, kwargs in (("bf16", {"compute_dtype": torch.bfloat16,
                                    "reduce_dtype": torch.float32}), ("fp32", {})):
        buf = DBuffer.from_tensors(full_tensors(p, 0), p, **kwargs)
        for n in buf.names:
            buf.grad_view(n).copy_(rank_grads(p, 0, rank)[n])
        handle = buf.reduce_scatter("sum", async_op=True, free_grad=True)
        after_issue = buf.has_grad
        handle.wait()
        held[label] = [after_issue, buf.has_grad]
        expected = {n: sum(rank_grads(p, 0, r)[n].to(kwargs.get("compute_dtype", torch.float32))
                           .float() for r in range(world)) for n in buf.names}
        for n in buf.names:
            assert torch.equal(buf.sharded_grad_view(n), local_piece(p, n, rank, expected[n])), n
    return held


@pytest.mark.parametrize("world_size", (2, 3))
def test_reduce_scatter_can_release_the_gradient_buffer_early(ranks, world_size: int) -> None:
    for held in ranks.run(world_size, _free_grad_early_case, zero_unit_plan(world_size)):
        assert held == {"bf16": [False, False], "fp32": [True, False]}
