"""Every dtype FSDP2 accepts, and groups of one rank.

* float64 buffers (master copy, compute or reduce dtype) gather and reduce exactly like the
  single-device reference, at world sizes 1-3 (3 has ranks owning no unit of some tensors);
* float8, integer and bool buffers (frozen only) gather their bytes exactly, float8 also cast
  into a bf16 compute dtype; a trainable one, or a cast of an integer or bool one, raises
  ``TypeError`` on every rank;
* the fused kernels compute float64 in float64 (torch path) and refuse the fp32-only Triton
  kernels for it when asked explicitly;
* on a group of one rank (world size 1, or a size-1 dimension of a 2-D mesh) no collective is
  issued, and the results are the same as with one.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dbuffer import DBuffer, kernels
from tests.dbuffer.cases import Case, full_tensors, grad_sum, local_piece, random_plan, rank_grads
from tests.dbuffer.collective_log import record_collectives
from tests.dbuffer.test_buffer import _check_gather_and_reduce, _fill_grads
from tests.harness import device_mesh

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
NON_FLOAT = (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)


def _float64_cases(cases: list[Case]) -> list[str]:
    """Run the gather/reduce checks; return the collectives issued (none on one rank)."""
    with record_collectives() as log:
        for case in cases:
            _check_gather_and_reduce(case)
    return [c.name for c in log]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_float64_buffers_match_single_device(ranks, world_size: int) -> None:
    rng = random.Random(640 + world_size)
    f64 = torch.float64
    cases = [Case(random_plan(rng, world_size), seed=1, dtype=f64),
             Case(random_plan(rng, world_size), seed=2, dtype=f64, async_op=True),
             Case(random_plan(rng, world_size), seed=3, compute_dtype=f64, reduce_dtype=f64),
             Case(random_plan(rng, world_size), seed=4, dtype=f64,
                  compute_dtype=torch.float32, reduce_dtype=f64)]
    for names in ranks.run(world_size, _float64_cases, cases):
        if world_size == 1:
            assert names == [], names  # FSDP2 issues none on one rank either
        else:
            assert "all_gather_single" in names and "reduce_scatter_single" in names


def _byte_case(plan_: object, dtype: torch.dtype) -> dict[str, object]:
    rank = dist.get_rank()
    # dyadic values: exact in fp8; scaled so that integers and bools differ across elements
    full = {n: (t * 16).to(dtype) for n, t in full_tensors(plan_, 7).items()}
    out: dict[str, object] = {}
    try:
        DBuffer.from_tensors(full, plan_, dtype=dtype, compute_dtype=torch.bfloat16,
                             requires_grad=())
    except TypeError as error:
        out["cast"] = str(error)
    for compute in (None, torch.bfloat16) if dtype.is_floating_point else (None,):
        buf = DBuffer.from_tensors(full, plan_, dtype=dtype, compute_dtype=compute,
                                   requires_grad=())
        for async_op in (False, True):
            handle = buf.all_gather(async_op=async_op)
            if handle is not None:
                handle.wait()
            for name, t in full.items():
                view = buf.unsharded_view(name)
                expected = t if compute is None else t.to(compute)
                assert view.dtype == expected.dtype
                assert torch.equal(view.view(torch.uint8) if compute is None else view,
                                   expected.view(torch.uint8) if compute is None else expected)
                assert torch.equal(buf.local_view(name).view(torch.uint8),
                                   local_piece(plan_, name, rank, t).view(torch.uint8))
            buf.free_unsharded()
    try:
        DBuffer.from_tensors(full, plan_, dtype=dtype)  # trainable: no gradients of bytes
    except TypeError as error:
        out["trainable"] = str(error)
    # the group is still usable: every rank left the failed construction at the same point
    buf = DBuffer.from_tensors(full, plan_, dtype=dtype, requires_grad=())
    try:
        buf.add_trainable(list(full)[:1])  # unfreezing later: no gradients of bytes either
    except TypeError as error:
        out["added"] = str(error)
    out["still_frozen"] = buf.trainable == ()
    buf.all_gather()
    out["after"] = all(torch.equal(buf.unsharded_view(n).float(), t.float())
                       for n, t in full.items())
    return out


@pytest.mark.parametrize("dtype", FP8 + NON_FLOAT, ids=str)
def test_frozen_byte_buffers_gather_bytes_exactly(ranks, dtype: torch.dtype) -> None:
    p = random_plan(random.Random(8), 3)
    for out in ranks.run(3, _byte_case, p, dtype):
        assert "holds no gradients" in out["trainable"] and "dtype" in out["trainable"]
        assert "holds no gradients" in out["added"] and out["still_frozen"]
        assert out["after"] is True
        if dtype.is_floating_point:
            assert "cast" not in out
        else:
            assert f"is not supported for a cast from {dtype}" in out["cast"]


def test_float64_kernels_compute_in_float64() -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(1000, dtype=torch.float64, generator=g)
    b = torch.randn(1000, dtype=torch.float64, generator=g)
    alpha = 1 / 3
    dst = a.clone()
    kernels.add_(dst, b, alpha)
    exact = a + alpha * b  # within an ulp of float64 (an fp32 path would be ~1e-8 off)
    scale = a.abs() + (alpha * b).abs()
    assert torch.all((dst - exact).abs() <= 2 * torch.finfo(torch.float64).eps * scale)
    dst = a.clone()
    kernels.scale_(dst, alpha)
    assert torch.equal(dst, a * alpha)
    dst = torch.empty_like(a)
    kernels.copy_cast_(dst, b.float(), alpha)
    assert torch.equal(dst, b.float().double() * alpha)
    dst = torch.empty(1000, dtype=torch.float32)
    kernels.copy_cast_(dst, b, alpha)
    assert torch.equal(dst, (b * alpha).float())
    assert kernels.squared_norm(a).dtype == torch.float64
    assert torch.equal(kernels.squared_norm(a), torch.linalg.vector_norm(a).square())
    kernels.zero_(dst)
    assert not dst.any()
    with pytest.raises(TypeError, match="backend='triton'.*torch.float64"):
        kernels.scale_(a, 2.0, backend="triton")
    with pytest.raises(TypeError, match="backend='triton'.*torch.float8_e4m3fn"):
        kernels.copy_cast_(torch.empty(4), torch.zeros(4, dtype=torch.float8_e4m3fn),
                           backend="triton")


def _mesh_case(shape: tuple[int, int], plan_: object, seed: int) -> dict[str, object]:
    """A DBuffer on a 2-D ``(replicate, shard)`` mesh with a size-1 dimension: results equal
    the sum over every rank; only the size>1 dimension's collectives run."""
    mesh = device_mesh(*shape)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard_rank = mesh.get_local_rank(1)
    full = full_tensors(plan_, seed)
    buf = DBuffer.from_tensors(full, plan_, mesh)
    with record_collectives() as log:
        buf.all_gather()
        gathered = all(torch.equal(buf.unsharded_view(n), t) for n, t in full.items())
        _fill_grads(buf, rank_grads(plan_, seed, rank))
        buf.reduce_scatter("sum")
    reference = grad_sum(plan_, seed, world)
    reduced = all(torch.equal(buf.sharded_grad_view(e.name),
                              local_piece(plan_, e.name, shard_rank, reference[e.name]))
                  for e in plan_.entries)
    return {"gathered": gathered, "reduced": reduced, "collectives": sorted(c.name for c in log)}


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_size_one_mesh_dimension_issues_no_collective(ranks, shape: tuple[int, int]) -> None:
    p = random_plan(random.Random(11), shape[1])
    for out in ranks.run(2, _mesh_case, shape, p, 4):
        assert out["gathered"] and out["reduced"]
        if shape == (1, 2):  # no replicas: all-gather and reduce-scatter, no all-reduce
            assert out["collectives"] == ["all_gather_single", "reduce_scatter_single"]
        else:  # one shard per replica: only the HSDP all-reduce
            assert out["collectives"] == ["all_reduce"]
