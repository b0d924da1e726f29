"""DBuffer correctness on gloo ranks against single-device references: gathered tensors equal
the originals, reduce-scattered gradients equal the sum/average of every rank's gradients
(fp32, bf16 compute with fp32 reduce, HSDP 2x2), accumulation, lifetimes, frozen tensors."""

from __future__ import annotations

import os
import random
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from layout_planner import Plan
from ragged_dtensor import RaggedShard
from torch.distributed.tensor import Replicate

from dbuffer import DBuffer, FreedBufferError
from dbuffer.kernels import dispatch
from tests.dbuffer.cases import Case, full_tensors, grad_sum, local_piece, random_plan, rank_grads
from tests.dbuffer.collective_log import record_collectives
from tests.harness import device_mesh

WORLD_SIZES = (1, 2, 3, 4)


def assert_average(got: torch.Tensor, total: torch.Tensor, ranks: int, ulps: int = 1) -> None:
    """``got`` equals ``total / ranks`` (exact quotient, in fp64) to within ``ulps`` ulps of
    ``got``'s dtype: a correctly rounded division is within half an ulp, a multiplication by
    the rounded reciprocal within one."""
    exact = total.double() / ranks
    tolerance = ulps * torch.finfo(got.dtype).eps * exact.abs()
    assert torch.all((got.double() - exact).abs() <= tolerance), (got, exact)


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
            total = local_piece(p, name.name, rank, reference[name.name])
            got = buf.sharded_grad_view(name.name)
            assert got.dtype == case.dtype
            if op == "sum":
                assert torch.equal(got, total.to(case.dtype)), (op, name.name)
            elif predivide and world & (world - 1):
                # dividing each rank's gradient by 3 before summing rounds each term (and
                # the partial sums) in the reduce dtype: at most ~world ulps of the largest
                # term, |g| / 3 <= 8 / 3 (rounded once more into a narrower sharded dtype).
                eps = max(torch.finfo(case.reduce_dtype or compute).eps,
                          torch.finfo(case.dtype).eps)
                torch.testing.assert_close(got.double(), total.double() / world, rtol=0,
                                           atol=world * eps * 8 / 3)
            else:
                assert_average(got, total, world)
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
        total = local_piece(p, entry.name, rank, reference[entry.name])
        # avg of 2 passes, then avg of 1 more pass, accumulated: 3 * sum / world, with two
        # roundings (the first average, then the fused add of the second): 2 ulps.
        assert_average(buf.sharded_grad_view(entry.name), 3 * total, world, ulps=2)


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
                expected = expected / 4
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
    with pytest.raises(ValueError, match="differ across ranks.*DBuffer plan/dtype fingerprint"):
        DBuffer(other if rank == 3 else good, mesh)
    with pytest.raises(TypeError, match="rank 3: TypeError: compute_dtype"):
        DBuffer(good, mesh, compute_dtype=torch.int8 if rank == 3 else None)
    with record_collectives() as log:  # the construction check: one small all-reduce per dim
        DBuffer(good, mesh)
    assert [(c.name, c.input_numel) for c in log] == [("all_reduce", 3)] * 2, log


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
    buf.all_gather()
    views = {n: buf.unsharded_view(n) for n in buf.names}
    flat = buf.unsharded_buffer
    before = {n: v.clone() for n, v in views.items()}
    alias = views[name].detach()  # an alias DBuffer did not hand out
    buf.free_unsharded()
    assert buf.unsharded_view.__self__ is buf and not buf.is_unsharded
    for n, v in views.items():  # the same objects, now over a zero-byte storage
        assert v.untyped_storage().nbytes() == 0 and v.shape == before[n].shape
        _assert_every_use_raises(v, f"unsharded view of '{n}'.*all_gather")
    _assert_every_use_raises(flat, "unsharded parameter buffer is freed")
    with pytest.raises(RuntimeError, match="data pointer"):
        alias.add_(1)  # writes through any alias raise (reads through one are not covered)
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
    # Every free fences the same objects again and every re-gather gives them their own
    # class back: the error still names the tensor on a later free.
    gathered = {n: v.clone() for n, v in views.items()}
    for _ in range(2):
        buf.free_unsharded()
        for n, v in views.items():
            _assert_every_use_raises(v, f"unsharded view of '{n}'.*all_gather")
        buf.all_gather()
        assert type(flat) is torch.Tensor
        assert all(type(v) is torch.Tensor for v in views.values())
        assert all(torch.equal(v, gathered[n]) for n, v in views.items())


def _assert_every_use_raises(view: torch.Tensor, match: str) -> None:
    """Reads, writes, printing and use in a layer all raise (none may crash or return)."""
    uses = [lambda: view.sum(), lambda: view.add_(1), lambda: view.clone(),
            lambda: print(view), lambda: view + 1, lambda: view.tolist(),
            lambda: view.reshape(-1)[0], lambda: torch.nn.functional.linear(
                torch.ones(2, view.shape[-1], dtype=view.dtype), view),
            lambda: torch._foreach_mul_([view], 2.0), lambda: view.detach()]
    for use in uses:
        with pytest.raises(FreedBufferError, match=match):
            use()


def _freed_grad_views_raise(case: Case) -> None:
    """Unsharded gradient views raise while their buffer is freed and work again afterwards;
    sharded gradients are owned by reference: a view handed out keeps its values after
    free_sharded_grad, and the memory goes when the last view is let go."""
    p = case.plan
    buf = DBuffer.from_tensors(full_tensors(p, case.seed), p, **case.kwargs)
    grads = rank_grads(p, case.seed, dist.get_rank())
    reference = grad_sum(p, case.seed, dist.get_world_size())
    _fill_grads(buf, grads)
    gviews = {n: buf.grad_view(n) for n in buf.names}
    buf.reduce_scatter("sum")
    sviews = {n: buf.sharded_grad_view(n) for n in buf.names}
    flat = weakref.ref(buf.sharded_grad_buffer)
    buf.free_grad()
    buf.free_sharded_grad()
    assert not buf.has_sharded_grad
    with pytest.raises(FreedBufferError, match="sharded_grad_view.*reduce_scatter"):
        buf.sharded_grad_view(p.entries[0].name)
    for n in buf.names:
        _assert_every_use_raises(gviews[n], f"grad view of '{n}'.*unsharded gradient buffer")
        assert torch.equal(sviews[n], local_piece(p, n, buf.rank, reference[n]).to(case.dtype))
    assert flat() is not None  # the views hold the memory ...
    old = sviews
    sviews = {}
    del old
    assert flat() is None  # ... and nothing else does
    assert buf.grad_view(p.entries[0].name) is gviews[p.entries[0].name]
    assert all(not v.any() for v in gviews.values())  # re-allocated zero-filled, usable
    _fill_grads(buf, grads)
    buf.reduce_scatter("sum")
    for n in buf.names:
        assert torch.equal(buf.sharded_grad_view(n),
                           local_piece(p, n, buf.rank, reference[n]).to(case.dtype))


def _frozen_case(case: Case) -> None:
    p = case.plan
    names = [e.name for e in p.entries]
    # every other tensor frozen: gaps between the trainable runs of the sharded buffer
    trainable, frozen_names = names[1::2], names[::2]
    buf = DBuffer.from_tensors(full_tensors(p, case.seed), p, requires_grad=trainable,
                               **case.kwargs)
    assert buf.trainable == tuple(trainable)
    for n in frozen_names:
        with pytest.raises(ValueError, match=f"'{n}' is frozen"):
            buf.grad_view(n)
    itemsizes = (buf.compute_dtype.itemsize, buf.dtype.itemsize)
    local = sum(e - s for s, e in (p.local_range(n, buf.rank) for n in frozen_names))
    expected_bytes = sum(p.entry(n).numel for n in frozen_names) * itemsizes[0] + \
        local * itemsizes[1] if trainable else 0  # no trainable tensor: no gradient memory
    assert buf.frozen_grad_bytes == expected_bytes
    if trainable:  # mixed: the reserved space is announced
        with pytest.warns(UserWarning, match=f"{len(frozen_names)} frozen tensor.*"
                                             f"{expected_bytes} bytes"):
            DBuffer(p, requires_grad=trainable, **case.kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # all or none trainable: none reserved
        assert DBuffer(p, **case.kwargs).frozen_grad_bytes == 0
        frozen = DBuffer.from_tensors(full_tensors(p, case.seed), p, requires_grad=(),
                                      **case.kwargs)
    assert frozen.trainable == () and not frozen.has_grad and frozen.frozen_grad_bytes == 0
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
        for n in frozen_names:
            start, end = p.local_range(n, buf.rank)
            offset = p.entry(n).offset + start - buf.rank * p.shard_size
            assert not buf.sharded_grad_buffer[offset:offset + end - start].any()
            assert not buf.grad_buffer[p.entry(n).offset:p.entry(n).offset + p.entry(n).numel].any()
    _unfrozen_case(case, frozen)


def _unfrozen_case(case: Case, frozen: DBuffer) -> None:
    """``add_trainable`` on a buffer built frozen: the added tensors get gradients that reduce
    like any others, the rest stay frozen, and the unsharded views handed out before (which
    a pending autograd graph may hold) stay the same objects over the same memory."""
    p = case.plan
    names = [e.name for e in p.entries]
    added, still_frozen = names[:1], names[1:]
    view = frozen.unsharded_view(added[0])  # gathered above
    before = view.clone()
    if still_frozen:
        with pytest.warns(UserWarning, match=f"{len(still_frozen)} frozen tensor"):
            frozen.add_trainable(added)  # the rest keep gradient space reserved: said so
    else:
        frozen.add_trainable(added)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        frozen.add_trainable(added)  # again: no change, no warning
    with pytest.raises(TypeError, match="collection of tensor names"):
        frozen.add_trainable(added[0])
    assert frozen.trainable == tuple(added)
    assert frozen.requires_grad(added[0]) and not any(map(frozen.requires_grad, still_frozen))
    assert frozen.unsharded_view(added[0]) is view and torch.equal(view, before)
    for n in still_frozen:
        with pytest.raises(ValueError, match=f"'{n}' is frozen"):
            frozen.grad_view(n)
    with pytest.raises(KeyError, match="not in this DBuffer"):
        frozen.add_trainable(["no such tensor"])
    _fill_grads(frozen, rank_grads(p, case.seed, dist.get_rank()))
    frozen.reduce_scatter("sum")
    reference = grad_sum(p, case.seed, dist.get_world_size())
    assert torch.equal(frozen.sharded_grad_view(added[0]),
                       local_piece(p, added[0], frozen.rank, reference[added[0]]).to(case.dtype))


def _lifetime_cases(cases: list[Case]) -> None:
    for case in cases:
        _lifetime_case(case)
        _freed_grad_views_raise(case)
        _frozen_case(case)


def _silent_rank_case(case: Case, silent: int) -> None:
    """Rank ``silent`` never writes a gradient (its experts got no tokens): it contributes
    zeros instead of raising while the others wait in the collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p = case.plan
    buf = DBuffer.from_tensors(full_tensors(p, case.seed), p, **case.kwargs)
    grads = [rank_grads(p, case.seed, r) for r in range(world)]
    for op in ("sum", "avg"):
        if rank != silent:
            _fill_grads(buf, grads[rank])
        buf.free_sharded_grad()
        buf.reduce_scatter(op)
        for e in p.entries:
            total = sum(grads[r][e.name] for r in range(world) if r != silent)
            total = local_piece(p, e.name, rank, total)
            got = buf.sharded_grad_view(e.name)
            if op == "sum":
                assert torch.equal(got, total.to(case.dtype)), e.name
            else:
                assert_average(got, total, world)
        buf.free_grad()


def test_rank_without_gradients_contributes_zeros(ranks) -> None:
    rng = random.Random(23)
    cases = [Case(random_plan(rng, 3), seed=4),
             Case(random_plan(rng, 3), seed=6, compute_dtype=torch.bfloat16,
                  reduce_dtype=torch.float32)]
    ranks.run(3, _silent_rank_cases, cases, 1)


def _silent_rank_cases(cases: list[Case], silent: int) -> None:
    for case in cases:
        _silent_rank_case(case, silent)


@pytest.mark.parametrize("world_size", (1, 3))
def test_lifetimes_views_and_frozen_tensors(ranks, world_size: int) -> None:
    rng = random.Random(11 + world_size)
    cases = [Case(random_plan(rng, world_size), seed=i) for i in range(2)]
    cases.append(Case(random_plan(rng, world_size), seed=5, compute_dtype=torch.bfloat16))
    ranks.run(world_size, _lifetime_cases, cases)
