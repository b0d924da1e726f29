"""DBuffer correctness on gloo ranks against single-device references: gathered tensors equal
the originals, reduce-scattered gradients equal the sum/average of every rank's gradients
(fp32, bf16 compute with fp32 reduce, HSDP 2x2), accumulation, lifetimes, frozen tensors."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
from layout_planner import Plan
from ragged_dtensor import RaggedShard
from torch.distributed.tensor import Replicate

from dbuffer import DBuffer, FreedBufferError
from dbuffer.kernels import dispatch
from tests.dbuffer.cases import Case, full_tensors, grad_sum, local_piece, random_plan, rank_grads
from tests.harness import device_mesh

WORLD_SIZES = (1, 2, 3, 4)


def _fill_grads(buf: DBuffer, grads: dict[str, torch.Tensor]) -> None:
    for name in buf.trainable:
        buf.grad_view(name).copy_(grads[name])


def _check_gather_and_reduce(case: Case) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    p = case.plan
    full = full_tensors(p, case.seed)
    buf = DBuffer.from_tensors(full, p, **case.kwargs)
    compute = case.compute_dtype or case.dtype

    handle = buf.all_gather(async_op=case.async_op)
    if case.async_op:
        handle.wait()
    for name, t in full.items():
        view = buf.unsharded_view(name)
        assert view.dtype == compute and view.shape == t.shape
        assert torch.equal(view, t.to(compute)), name
        assert torch.equal(buf.local_view(name), local_piece(p, name, rank, t).to(case.dtype))

    reference = grad_sum(p, case.seed, world)
    for op, predivide in (("sum", False), ("avg", False), ("avg", True)):
        _fill_grads(buf, rank_grads(p, case.seed, rank))
        buf.free_sharded_grad()
        handle = buf.reduce_scatter(op, async_op=case.async_op, predivide=predivide)
        if case.async_op:
            handle.wait()
        for name in p.entries:
            expected = local_piece(p, name.name, rank, reference[name.name])
            if op == "avg":
                expected = expected * torch.tensor(1 / world)
            got = buf.sharded_grad_view(name.name)
            assert got.dtype == case.dtype
            if predivide and world & (world - 1):
                # dividing each rank's gradient by 3 before summing rounds each term (and
                # the partial sums) in the reduce dtype: at most ~world ulps of the largest
                # term, |g| / 3 <= 8 / 3.
                eps = torch.finfo(case.reduce_dtype or compute).eps
                torch.testing.assert_close(got, expected.to(case.dtype), rtol=0,
                                           atol=world * eps * 8 / 3)
            else:
                assert torch.equal(got, expected.to(case.dtype)), (op, predivide, name.name)
        buf.free_grad()
    buf.free_unsharded()


def _gather_reduce_cases(cases: list[Case]) -> None:
    for case in cases:
        _check_gather_and_reduce(case)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_and_reduce_scatter_match_single_device(ranks, world_size: int) -> None:
    rng = random.Random(100 + world_size)
    cases = []
    for i in range(4):
        p = random_plan(rng, world_size)
        cases.append(Case(p, seed=i, async_op=bool(i % 2)))
        cases.append(Case(p, seed=i + 50, compute_dtype=torch.bfloat16,
                          reduce_dtype=torch.float32, async_op=bool(i % 2)))
    cases.append(Case(random_plan(rng, world_size), seed=99, compute_dtype=torch.bfloat16))
    cases.append(Case(random_plan(rng, world_size), seed=98, dtype=torch.bfloat16))
    ranks.run(world_size, _gather_reduce_cases, cases)


def _triton_cases(cases: list[Case]) -> None:
    """The same checks with every DBuffer kernel on the Triton path (interpreter)."""
    launches = dispatch._triton.cache_info()
    os.environ["DBUFFER_KERNELS"] = "triton"
    try:
        _gather_reduce_cases(cases)
    finally:
        del os.environ["DBUFFER_KERNELS"]
    # the fused ops really went to the Triton kernels (each launch looks the module up)
    after = dispatch._triton.cache_info()
    assert after.hits + after.misses >= launches.hits + launches.misses + 4 * len(cases)


def test_gather_and_reduce_scatter_on_triton_kernels(ranks) -> None:
    rng = random.Random(77)
    p = random_plan(rng, 2)
    cases = [Case(p, seed=1, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32),
             Case(p, seed=2, compute_dtype=torch.bfloat16, async_op=True)]
    ranks.run(2, _triton_cases, cases)


def _accumulation_case(case: Case) -> None:
    """Two backward passes into the unsharded gradients, then a reduce-scatter; one more pass
    and a second reduce-scatter accumulate into the sharded gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p = case.plan
    buf = DBuffer.from_tensors(full_tensors(p, case.seed), p, **case.kwargs)
    buf.all_gather()
    params = {n: buf.unsharded_view(n).detach().requires_grad_() for n in buf.names}
    coeffs = rank_grads(p, case.seed, rank)

    def backward() -> None:
        for name, param in params.items():
            param.grad = buf.grad_view(name)
        loss = sum((param * coeffs[name].to(param.dtype)).sum() for name, param in params.items())
        loss.backward()

    backward()
    backward()
    grad_ptr = buf.grad_buffer.untyped_storage().data_ptr()
    for name, param in params.items():
        assert param.grad is buf.grad_view(name)
        assert param.grad.untyped_storage().data_ptr() == grad_ptr
    buf.reduce_scatter("avg")
    buf.free_grad()
    assert buf.grad_view(p.entries[0].name).untyped_storage().nbytes() > 0
    assert not buf.grad_buffer.any()  # re-allocated zero-filled
    backward()
    buf.reduce_scatter("avg")
    reference = grad_sum(p, case.seed, world)
    for entry in p.entries:
        expected = local_piece(p, entry.name, rank, reference[entry.name])
        # avg of 2 passes, then avg of 1 more pass, accumulated: 3 * sum / world.
        expected = (expected * 2) * torch.tensor(1 / world) + expected * torch.tensor(1 / world)
        assert torch.equal(buf.sharded_grad_view(entry.name), expected.to(case.dtype)), entry.name


def _accumulation_cases(cases: list[Case]) -> None:
    for case in cases:
        _accumulation_case(case)


@pytest.mark.parametrize("world_size", (2, 3))
def test_gradient_accumulation_across_backward_and_reduce_scatter(ranks, world_size: int) -> None:
    rng = random.Random(7 + world_size)
    cases = [Case(random_plan(rng, world_size), seed=1),
             Case(random_plan(rng, world_size), seed=2, compute_dtype=torch.bfloat16,
                  reduce_dtype=torch.float32),
             Case(random_plan(rng, world_size), seed=3, compute_dtype=torch.bfloat16)]
    ranks.run(world_size, _accumulation_cases, cases)


def _hsdp_case(case: Case) -> None:
    mesh = device_mesh(2, 2)
    shard_rank = mesh.get_local_rank(1)
    p = case.plan
    full = full_tensors(p, case.seed)
    buf = DBuffer.from_tensors(full, p, mesh, **case.kwargs)
    buf.all_gather()
    for name, t in full.items():
        assert torch.equal(buf.unsharded_view(name), t.to(buf.compute_dtype))
    reference = grad_sum(p, case.seed, 4)
    for op in ("sum", "avg"):
        _fill_grads(buf, rank_grads(p, case.seed, dist.get_rank()))
        buf.free_sharded_grad()
        handle = buf.reduce_scatter(op, async_op=case.async_op)
        if case.async_op:
            handle.wait()
        for entry in p.entries:
            expected = local_piece(p, entry.name, shard_rank, reference[entry.name])
            if op == "avg":
                expected = expected * torch.tensor(1 / 4)
            assert torch.equal(buf.sharded_grad_view(entry.name), expected), (op, entry.name)
    for name, t in full.items():
        sharded = buf.sharded_param(name)
        assert isinstance(sharded.placements[0], Replicate)
        assert isinstance(sharded.placements[1], RaggedShard)
        assert sharded.to_local().untyped_storage().data_ptr() == \
            buf.sharded_buffer.untyped_storage().data_ptr()


def _hsdp_cases(cases: list[Case], other: Plan) -> None:
    for case in cases:
        _hsdp_case(case)
    # Errors on one rank of the 2x2 mesh reach every rank (across both mesh dimensions).
    mesh, rank, good = device_mesh(2, 2), dist.get_rank(), cases[0].plan
    with pytest.raises(ValueError, match="fingerprint differs across ranks"):
        DBuffer(other if rank == 3 else good, mesh)
    with pytest.raises(TypeError, match="rank 3: TypeError: compute_dtype"):
        DBuffer(good, mesh, compute_dtype=torch.int8 if rank == 3 else None)


def test_hsdp_2x2_equals_sum_over_all_ranks(ranks) -> None:
    rng = random.Random(5)
    cases = [Case(random_plan(rng, 2), seed=i, async_op=bool(i % 2)) for i in range(3)]
    cases.append(Case(random_plan(rng, 2), seed=9, compute_dtype=torch.bfloat16,
                      reduce_dtype=torch.float32))
    other = random_plan(rng, 2)
    while other.fingerprint() == cases[0].plan.fingerprint():
        other = random_plan(rng, 2)
    ranks.run(4, _hsdp_cases, cases, other)


def _lifetime_case(case: Case) -> None:
    p = case.plan
    buf = DBuffer.from_tensors(full_tensors(p, case.seed), p, **case.kwargs)
    name = p.entries[0].name
    assert not buf.is_unsharded
    with pytest.raises(FreedBufferError, match=f"unsharded_view\\('{name}'\\).*all_gather"):
        buf.unsharded_view(name)
    with pytest.raises(FreedBufferError, match="sharded_grad_view.*reduce_scatter"):
        buf.sharded_grad_view(name)
    with pytest.raises(FreedBufferError, match="no gradient to reduce"):
        buf.reduce_scatter()
    buf.all_gather()
    views = {n: buf.unsharded_view(n) for n in buf.names}
    before = {n: v.clone() for n, v in views.items()}
    buf.free_unsharded()
    assert buf.unsharded_view.__self__ is buf and not buf.is_unsharded
    for v in views.values():  # the same objects, now over a zero-byte storage
        assert v.untyped_storage().nbytes() == 0
    with pytest.raises(FreedBufferError, match="freed"):
        buf.unsharded_view(name)
    with pytest.raises(FreedBufferError):
        _ = buf.unsharded_buffer
    buf.local_view(name).zero_()  # the sharded master copy changes while unsharded is freed
    buf.all_gather()
    for n, v in views.items():
        assert buf.unsharded_view(n) is v
        expected = before[n].clone()
        if n == name:
            start, end = p.local_range(n, buf.rank)
            expected.view(-1)[start:end] = 0
            # other ranks zeroed their own pieces too
            for r in range(buf.world_size):
                s, e = p.local_range(n, r)
                expected.view(-1)[s:e] = 0
        assert torch.equal(v, expected), n
    # Reshard after forward, re-gather for backward: tensors saved for backward stay valid
    # (the re-gather does not bump the autograd version counter).
    w = buf.unsharded_view(name).detach().requires_grad_()
    loss = (w * w).sum()
    buf.free_unsharded()
    buf.all_gather()
    loss.backward()
    assert torch.equal(w.grad, 2 * buf.unsharded_view(name))


def _frozen_case(case: Case) -> None:
    p = case.plan
    names = [e.name for e in p.entries]
    trainable = names[: len(names) // 2]
    buf = DBuffer.from_tensors(full_tensors(p, case.seed), p, requires_grad=trainable,
                               **case.kwargs)
    assert buf.trainable == tuple(trainable)
    for n in names[len(names) // 2:]:
        with pytest.raises(ValueError, match=f"'{n}' is frozen"):
            buf.grad_view(n)
    frozen = DBuffer.from_tensors(full_tensors(p, case.seed), p, requires_grad=(), **case.kwargs)
    assert frozen.trainable == () and not frozen.has_grad
    with pytest.raises(ValueError, match="frozen"):
        _ = frozen.grad_buffer
    with pytest.raises(ValueError, match="frozen"):
        frozen.reduce_scatter()
    frozen.all_gather()  # gathering still works
    # A frozen tensor's region of the gradient buffer stays zero through a reduce-scatter.
    if trainable:
        _fill_grads(buf, rank_grads(p, case.seed, dist.get_rank()))
        buf.reduce_scatter("sum")
        reference = grad_sum(p, case.seed, dist.get_world_size())
        for n in trainable:
            assert torch.equal(buf.sharded_grad_view(n),
                               local_piece(p, n, buf.rank, reference[n]))


def _lifetime_cases(cases: list[Case]) -> None:
    for case in cases:
        _lifetime_case(case)
        _frozen_case(case)


@pytest.mark.parametrize("world_size", (1, 3))
def test_lifetimes_views_and_frozen_tensors(ranks, world_size: int) -> None:
    rng = random.Random(11 + world_size)
    cases = [Case(random_plan(rng, world_size), seed=i) for i in range(2)]
    cases.append(Case(random_plan(rng, world_size), seed=5, compute_dtype=torch.bfloat16))
    ranks.run(world_size, _lifetime_cases, cases)
