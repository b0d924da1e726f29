"""DBuffer's in-place collectives on gloo (``dbuffer.gloo_collectives``): the same values as
gloo's own ``all_gather_single`` / ``reduce_scatter_single`` for every dtype DBuffer moves,
sync and async, at world sizes 2 and 3; no allocation while they run where gloo's own stage the
whole tensor (exact allocator bytes); DBuffer runs them only where it may and where they pay
off: the reduce-scatter destroys its input, so a reduction that keeps the unsharded gradients
(``free_grad=False``) runs gloo's own and leaves them intact, and slices under
``MIN_SLICE_BYTES`` run gloo's own single collective (lower latency)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dbuffer import DBuffer, gloo_collectives
from tests.benchmark_modules import load_benchmark
from tests.dbuffer.cases import full_tensors, random_plan, rank_grads
from tests.dbuffer.collective_log import WATCHED
from torch.distributed import distributed_c10d

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _data(numel: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    # small integers: sums are exact in every dtype, so any summation order gives one answer
    return (torch.arange(numel) % 7 + rank).to(dtype)


def _values_case() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    problems = []
    for dtype in (*DTYPES, torch.uint8):
        for async_op in (False, True):
            for size in (0, 1, 5):
                shard = _data(size, dtype, rank)
                ours, ref = torch.full((world * size,), -1).to(dtype), torch.empty(world * size, dtype=dtype)
                work = gloo_collectives.all_gather_single(ours, shard, group=group, async_op=async_op)
                if work is not None:
                    work.wait()
                dist.all_gather_single(ref, shard, group=group)
                if not torch.equal(ours, ref):
                    problems.append(f"all-gather {dtype} {size} async={async_op}: {ours} != {ref}")
                inplace = ref.clone()
                inplace.narrow(0, rank * size, size).fill_(0)
                inplace.narrow(0, rank * size, size).copy_(shard)
                gloo_collectives.all_gather_single(inplace, inplace.narrow(0, rank * size, size),
                                                   group=group)
                if not torch.equal(inplace, ref):
                    problems.append(f"in-place all-gather {dtype} {size}")
                if dtype == torch.uint8:
                    continue
                full = _data(world * size, dtype, rank)
                out, expected = torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype)
                dist.reduce_scatter_single(expected, full.clone(), op=dist.ReduceOp.SUM, group=group)
                work = gloo_collectives.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM,
                                                              group=group, async_op=async_op)
                if work is not None:
                    work.wait()
                    if not work.is_completed():
                        problems.append("a waited Works is not completed")
                if not torch.equal(out, expected):
                    problems.append(f"reduce-scatter {dtype} {size} async={async_op}: {out} != {expected}")
                if not torch.equal(full.narrow(0, rank * size, size), expected):
                    problems.append(f"reduce-scatter {dtype} {size}: own slice of the input is not the result")
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_values_equal_gloos_own_collectives(ranks: Any, world: int) -> None:
    for problems in ranks.run(world, _values_case):
        assert problems == []



def _extra_bytes(run: Any) -> int:
    """Peak allocator bytes while ``run`` runs, over the bytes before it."""
    alloc_bytes = load_benchmark("alloc_bytes")
    alloc_bytes.report_cpu_memory(True)
    try:
        with alloc_bytes.AllocatorTrace() as trace:
            trace.mark("before")
            run()
            trace.mark("after")
        timeline = trace.timeline()
        return timeline.peak("before", "after")[0] - timeline.bytes_at(timeline.marks["before"])
    finally:
        alloc_bytes.report_cpu_memory(False)


def _memory_case() -> dict[str, int]:
    world = dist.get_world_size()
    size = 1 << 18  # 1 MiB of fp32 per rank
    shard, full = torch.ones(size), torch.ones(world * size)
    out_full, out_shard = torch.empty(world * size), torch.empty(size)
    group = dist.group.WORLD
    figures = {
        "gloo all_gather_single": _extra_bytes(
            lambda: dist.all_gather_single(out_full, shard, group=group)),
        "ours all-gather": _extra_bytes(
            lambda: gloo_collectives.all_gather_single(out_full, shard, group=group)),
        "gloo reduce_scatter_single": _extra_bytes(
            lambda: dist.reduce_scatter_single(out_shard, full, group=group)),
        "ours reduce-scatter": _extra_bytes(
            lambda: gloo_collectives.reduce_scatter_single(out_shard, full, op=dist.ReduceOp.SUM,
                                                           group=group)),
    }
    assert torch.equal(out_shard, torch.full((size,), float(world)))
    return figures


def test_no_staging_where_gloo_stages_the_whole_tensor(ranks: Any) -> None:
    world, whole = 2, 2 * (1 << 18) * 4
    for figures in ranks.run(world, _memory_case):
        # gloo's own copy the whole tensor through a temporary (the control: the method sees it)
        assert figures["gloo all_gather_single"] >= whole
        assert figures["gloo reduce_scatter_single"] >= whole
        assert figures["ours all-gather"] == 0, figures
        assert figures["ours reduce-scatter"] == 0, figures


def _dist_calls(fn: Any) -> list[str]:
    """Names of the torch.distributed collectives ``fn`` calls, nested ones included."""
    names: list[str] = []
    originals = {n: getattr(distributed_c10d, n) for n in WATCHED}

    def wrap(name: str, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            names.append(name)
            return original(*args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(distributed_c10d, name, wrap(name, original))
        setattr(dist, name, getattr(distributed_c10d, name))
    try:
        fn()
    finally:
        for name, original in originals.items():
            setattr(distributed_c10d, name, original)
            setattr(dist, name, original)
    return names


def _dbuffer_case(seed: int, min_slice_bytes: int) -> list[str]:
    """One plan's gather and reduction with the slice threshold at ``min_slice_bytes`` (0:
    every slice qualifies; the default: these small slices run gloo's own)."""
    world = dist.get_world_size()
    p = random_plan(random.Random(seed), world)
    full = full_tensors(p, seed)
    problems = []
    default, gloo_collectives.MIN_SLICE_BYTES = gloo_collectives.MIN_SLICE_BYTES, min_slice_bytes
    try:
        for free_grad in (True, False):
            problems += _dbuffer_round(p, full, seed, free_grad, in_place=min_slice_bytes == 0)
    finally:
        gloo_collectives.MIN_SLICE_BYTES = default
    return problems


def _dbuffer_round(p: Any, full: dict[str, torch.Tensor], seed: int, free_grad: bool,
                   in_place: bool) -> list[str]:
    """One gather and one reduction: which collectives ran, and their values."""
    world, rank = dist.get_world_size(), dist.get_rank()
    problems = []
    buf = DBuffer.from_tensors(full, p)
    gather = _dist_calls(buf.all_gather)
    if gather != (["broadcast"] * world if in_place else ["all_gather_single"]):
        problems.append(f"all-gather ran {gather}")
    if any(not torch.equal(buf.unsharded_view(n), full[n]) for n in full):
        problems.append("all-gather values")
    grads = rank_grads(p, seed, rank)
    for n in buf.trainable:
        buf.grad_view(n).copy_(grads[n])
    kept = buf.grad_buffer.clone()
    scatter = _dist_calls(lambda: buf.reduce_scatter("sum", free_grad=free_grad))
    expected = ["reduce"] * world if free_grad and in_place else ["reduce_scatter_single"]
    if scatter != expected:
        problems.append(f"free_grad={free_grad}: reduce-scatter ran {scatter}")
    if not free_grad and not torch.equal(buf.grad_buffer, kept):
        problems.append("free_grad=False: the unsharded gradients changed")
    totals = {n: sum(rank_grads(p, seed, r)[n] for r in range(world)) for n in buf.trainable}
    for n in buf.trainable:
        start, end = p.local_range(n, rank)
        got = buf.sharded_grad_view(n)
        if not torch.equal(got, totals[n].reshape(-1)[start:end]):  # dyadic: exact
            problems.append(f"free_grad={free_grad}: reduced gradient of {n!r}")
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_dbuffer_runs_them_only_where_the_input_may_be_destroyed(ranks: Any, world: int) -> None:
    for problems in ranks.run(world, _dbuffer_case, 11, 0):
        assert problems == []


def test_small_slices_run_gloos_own(ranks: Any) -> None:
    for problems in ranks.run(3, _dbuffer_case, 11, gloo_collectives.MIN_SLICE_BYTES):
        assert problems == []


def _threshold_case() -> list[bool]:
    world = dist.get_world_size()
    group = dist.group.WORLD
    at = world * gloo_collectives.MIN_SLICE_BYTES
    return [gloo_collectives.serves(group, torch.empty(at, dtype=torch.uint8)),
            gloo_collectives.serves(group, torch.empty(at - world, dtype=torch.uint8)),
            gloo_collectives.serves(group, torch.empty(at // 4, dtype=torch.float32))]


def test_serves_slices_from_the_threshold_up(ranks: Any) -> None:
    assert ranks.run(2, _threshold_case) == [[True, False, True]] * 2
