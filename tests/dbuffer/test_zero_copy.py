"""Zero-copy, asserted three ways: every view shares storage with its flat buffer at the plan's
offset; the tensors passed to each collective are DBuffer's own buffers (by data pointer),
with exactly one collective per all-gather and per reduce-scatter (plus one all-reduce on
HSDP); and a profile of all-gather + reduce-scatter shows no copy issued by DBuffer other
than its named fused casts (gloo's own staging copies are counted separately)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dbuffer import DBuffer
from dbuffer.profiling import copies
from tests.dbuffer.cases import Case, full_tensors, random_plan, rank_grads
from tests.dbuffer.collective_log import record_collectives
from tests.harness import device_mesh

FORBIDDEN = ("split_with_sizes_copy", "_chunk_cat", "aten::cat", "_foreach_copy_", "aten::clone")


def _same_storage(view: torch.Tensor, flat: torch.Tensor, offset: int) -> bool:
    return (view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and view.storage_offset() == offset and view.is_contiguous())


def _pointer_case(case: Case) -> None:
    p = case.plan
    full = full_tensors(p, case.seed)
    buf = DBuffer.from_tensors(full, p, **case.kwargs)
    S, rank = p.shard_size, buf.rank
    buf.all_gather()
    for e in p.entries:
        # the RaggedShard DTensor over the local view is the whole tensor, distributed
        assert torch.equal(buf.sharded_param(e.name).full_tensor(), full[e.name])
        assert _same_storage(buf.unsharded_view(e.name), buf.unsharded_buffer, e.offset)
        start, end = p.local_range(e.name, rank)
        if end > start:
            local_offset = e.offset + start - rank * S
            assert _same_storage(buf.local_view(e.name), buf.sharded_buffer, local_offset)
            assert _same_storage(buf.sharded_param(e.name).to_local(), buf.sharded_buffer,
                                 local_offset)
        assert _same_storage(buf.grad_view(e.name), buf.grad_buffer, e.offset)
        buf.grad_view(e.name).copy_(rank_grads(p, case.seed, rank)[e.name])
    buf.reduce_scatter()
    sharded_grad_ptr = buf.sharded_grad_buffer.untyped_storage().data_ptr()
    buf.reduce_scatter()  # accumulates in place: the buffer is never rebound
    assert buf.sharded_grad_buffer.untyped_storage().data_ptr() == sharded_grad_ptr
    for e in p.entries:
        start, end = p.local_range(e.name, rank)
        if end > start:
            offset = e.offset + start - rank * S
            assert _same_storage(buf.sharded_grad_view(e.name), buf.sharded_grad_buffer, offset)
            assert _same_storage(buf.sharded_grad(e.name).to_local(), buf.sharded_grad_buffer,
                                 offset)


def _profile_case(case: Case) -> dict[str, object]:
    p = case.plan
    buf = DBuffer.from_tensors(full_tensors(p, case.seed), p, **case.kwargs)
    for e in p.entries:
        buf.grad_view(e.name).copy_(rank_grads(p, case.seed, dist.get_rank())[e.name])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        buf.all_gather()
        buf.reduce_scatter("avg")
    events = prof.events()
    ours = [ev for ev in events if any(a.name.startswith("dbuffer::") for a in _chain(ev))]
    for ev in ours:
        in_backend = any(a.name.startswith(("c10d::", "gloo:")) for a in _chain(ev))
        assert in_backend or not any(f in ev.name for f in FORBIDDEN), ev.name
    found = copies(events)
    issued = [c for c in found if not c.backend]
    for c in issued:
        assert "dbuffer::copy_cast_" in c.ancestors, c
    return {"issued": len(issued), "backend_bytes": sum(c.nbytes for c in found if c.backend)}


def _chain(event: object) -> list:
    out = []
    parent = event.cpu_parent  # type: ignore[attr-defined]
    while parent is not None:
        out.append(parent)
        parent = parent.cpu_parent
    return out


def _ptr(tensor: torch.Tensor, element: int = 0) -> int:
    return tensor.data_ptr() + element * tensor.element_size()


def _collective_case(case: Case, hsdp: bool) -> None:
    """The collectives receive DBuffer's own buffers, one call each (async too)."""
    p = case.plan
    mesh = device_mesh(2, 2) if hsdp else None
    buf = DBuffer.from_tensors(full_tensors(p, case.seed), p, mesh, **case.kwargs)
    S, W, rank = p.shard_size, p.world_size, buf.rank
    cast = buf.compute_dtype != buf.dtype
    for step in range(2):  # the second gather re-allocates a freed buffer
        with record_collectives() as log:
            handle = buf.all_gather(async_op=case.async_op)
            if case.async_op:
                handle.wait()
        out = buf.unsharded_buffer
        expected_input = _ptr(out, rank * S) if cast else _ptr(buf.sharded_buffer)
        assert [c.name for c in log] == ["all_gather_single"], (step, log)
        call = log[0]
        assert call.async_op == case.async_op
        assert (call.output, call.input) == (_ptr(out), expected_input), (step, call)
        assert (call.output_numel, call.input_numel) == (W * S, S)
        buf.free_unsharded()
    for op in ("sum", "avg"):
        buf.free_sharded_grad()
        for e in p.entries:
            buf.grad_view(e.name).copy_(rank_grads(p, case.seed, rank)[e.name])
        with record_collectives() as log:
            handle = buf.reduce_scatter(op, async_op=case.async_op)
            if case.async_op:
                handle.wait()
        names = ["reduce_scatter_single"] + (["all_reduce"] if hsdp else [])
        assert [c.name for c in log] == names, (op, log)
        rs = log[0]
        assert rs.async_op == case.async_op
        assert (rs.output_numel, rs.input_numel) == (S, W * S)
        if buf.reduce_dtype == buf.compute_dtype:  # no cast before: the gradient buffer itself
            assert rs.input == _ptr(buf.grad_buffer), (op, rs)
        if buf.reduce_dtype == buf.dtype:  # no cast after: straight into the sharded grads
            assert rs.output == _ptr(buf.sharded_grad_buffer), (op, rs)
        if hsdp:  # the all-reduce runs in place on the reduce-scatter's output
            assert (log[1].output, log[1].output_numel) == (rs.output, S)
        buf.free_grad()


def _cases(cases: list[Case]) -> list[dict[str, object]]:
    results = []
    for case in cases:
        _pointer_case(case)
        _collective_case(case, hsdp=False)
        _collective_case(Case(case.plan, case.seed, case.dtype, case.compute_dtype,
                              case.reduce_dtype, async_op=True), hsdp=False)
        results.append(_profile_case(case))
    return results


def _hsdp_cases(cases: list[Case]) -> None:
    for case in cases:
        _collective_case(case, hsdp=True)


def test_hsdp_collectives_take_the_buffers_one_call_each(ranks) -> None:
    p = random_plan(random.Random(41), 2)
    cases = [Case(p, seed=1), Case(p, seed=2, async_op=True),
             Case(p, seed=3, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)]
    ranks.run(4, _hsdp_cases, cases)


@pytest.mark.parametrize("world_size", (2, 3))
def test_views_share_storage_and_no_copies_around_collectives(ranks, world_size: int) -> None:
    rng = random.Random(31 + world_size)
    p = random_plan(rng, world_size)
    cases = [
        Case(p, seed=1),  # no dtype change: no copy at all
        Case(p, seed=2, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        Case(p, seed=3, compute_dtype=torch.bfloat16),
    ]
    # Expected issued copies: 0; the shard cast + the gradient cast to fp32; the shard cast
    # + the cast of the bf16 reduced shard into the fp32 sharded gradients.
    expected = [0, 2, 2]
    results = ranks.run(world_size, _cases, cases)
    for rank_results in results:
        assert [r["issued"] for r in rank_results] == expected
        # gloo copies through temporaries on its own threads: present, and counted apart.
        assert all(r["backend_bytes"] > 0 for r in rank_results)
