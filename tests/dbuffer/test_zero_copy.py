"""Zero-copy, asserted two ways: every view shares storage with its flat buffer at the plan's
offset, and a profile of all-gather + reduce-scatter shows no copy issued by DBuffer other
than its named fused casts (gloo's own staging copies are counted separately)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dbuffer import DBuffer
from dbuffer.profiling import copies
from tests.dbuffer.cases import Case, full_tensors, random_plan, rank_grads

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


def _cases(cases: list[Case]) -> list[dict[str, object]]:
    results = []
    for case in cases:
        _pointer_case(case)
        results.append(_profile_case(case))
    return results


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
