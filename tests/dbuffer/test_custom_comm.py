"""``DBuffer.set_custom_all_gather`` / ``set_custom_reduce_scatter``: FSDP2's custom-collective
interface on a DBuffer. The comm's ``allocate`` provides the buffers its collective touches
(checked by address), its ``__call__`` runs the collective (counted), and the results equal
the default collectives' bit for bit, over several free/gather rounds and dtype mixes; an
``allocate`` that returns memory the buffer cannot own raises, naming the comm and the
buffer."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist

from dbuffer import DBuffer
from tests.comm_recorders import RecordingAllGather, RecordingReduceScatter
from tests.dbuffer.cases import full_tensors, random_plan
from tests.harness import device_mesh


def _round(buf: DBuffer, names: list[str], rank: int, step: int,
           async_op: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One gather, gradients from the gathered values, one reduce-scatter; what came out."""
    handle = buf.all_gather(async_op=async_op)
    if handle is not None:
        handle.wait()
    gathered = {n: buf.unsharded_view(n).clone() for n in names}
    for n in buf.trainable:
        buf.grad_view(n).copy_(gathered[n] * (rank + 1) + step)
    handle = buf.reduce_scatter(async_op=async_op, free_grad=True)
    if handle is not None:
        handle.wait()
    grads = buf.sharded_grad_buffer.clone()
    buf.free_sharded_grad()
    buf.free_unsharded()
    return gathered, grads


def _case(seed: int) -> list[str]:
    p = random_plan(random.Random(seed), dist.get_world_size())
    full = full_tensors(p, seed)
    names = [e.name for e in p.entries]
    rank = dist.get_rank()
    problems = []
    for kwargs in ({}, {"compute_dtype": torch.bfloat16},
                   {"compute_dtype": torch.bfloat16, "reduce_dtype": torch.float32}):
        ours, ref = DBuffer.from_tensors(full, p, **kwargs), DBuffer.from_tensors(full, p, **kwargs)
        gather, scatter = RecordingAllGather(), RecordingReduceScatter()
        ours.set_custom_all_gather(gather)
        ours.set_custom_reduce_scatter(scatter)
        for step, async_op in enumerate((False, True, True)):
            (g1, r1), (g2, r2) = (_round(b, names, rank, step, async_op) for b in (ours, ref))
            if any(not torch.equal(g1[n], g2[n]) for n in names) or not torch.equal(r1, r2):
                problems.append(f"{kwargs} round {step}: differs from the default collectives")
        ours.all_gather()
        if not gather.last_holds(ours.unsharded_buffer):
            problems.append(f"{kwargs}: the unsharded buffer is not the comm's memory")
        if ours.trainable:
            ours.grad_view(ours.trainable[0])
            if not scatter.last_holds(ours.grad_buffer):
                problems.append(f"{kwargs}: the gradient buffer is not the comm's memory")
        expected_rs = 3 if p.world_size > 1 else 0
        if gather.calls != 4 or len(scatter.ops) != expected_rs:
            problems.append(f"{kwargs}: {gather.calls} all-gathers, {len(scatter.ops)} "
                            f"reduce-scatters through the comms")
        if any(op != dist.ReduceOp.SUM for op in scatter.ops):
            problems.append(f"{kwargs}: reduce-scatter op {scatter.ops}")
    return problems


@pytest.mark.parametrize("world", [1, 3])
def test_custom_collectives_equal_the_default_ones(ranks, world: int) -> None:
    for problems in ranks.run(world, _case, 7):
        assert problems == []


class _Oversized(RecordingAllGather):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(size[0] + 8, dtype=dtype, device=device)[:size[0]]


def _oversized_case() -> tuple[str, bool]:
    from layout_planner import TensorSpec, plan

    p = plan([TensorSpec("w", 4, 1, (4,))], 1)
    buf = DBuffer.from_tensors({"w": torch.ones(4)}, p)
    buf.all_gather()  # allocated once by default, then freed: the comm's block replaces it
    buf.free_unsharded()
    buf.set_custom_all_gather(_Oversized())
    try:
        buf.all_gather()
        message = "no error"
    except TypeError as error:
        message = str(error)
    buf.set_custom_all_gather(None)
    buf.all_gather()
    return message, torch.equal(buf.unsharded_view("w"), torch.ones(4))


def test_allocate_must_return_memory_the_buffer_can_own(ranks) -> None:
    [(message, recovered)] = ranks.run(1, _oversized_case)
    assert "_Oversized.allocate((4,)" in message
    assert "unsharded parameter buffer" in message and "storage of 48 bytes" in message
    assert recovered


def _separate_group_case(seed: int) -> list[str]:
    """A reduce-scatter over a process group of its own equals one over the shard group, bit
    for bit, and runs over that group; a group over other ranks is refused."""
    from tests.dbuffer.collective_log import record_collectives

    p = random_plan(random.Random(seed), dist.get_world_size())
    full = full_tensors(p, seed)
    names = [e.name for e in p.entries]
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    ours, ref = DBuffer.from_tensors(full, p), DBuffer.from_tensors(full, p)
    group = dist.new_group(list(range(world)))
    ours.set_reduce_scatter_group(group)
    for step, async_op in enumerate((False, True)):
        with record_collectives() as log:
            _, r1 = _round(ours, names, rank, step, async_op)
        _, r2 = _round(ref, names, rank, step, async_op)
        if not torch.equal(r1, r2):
            problems.append(f"round {step}: differs from the shard group's reduce-scatter")
        used = {c.group_name for c in log if c.name == "reduce_scatter_single"}
        if used != {group.group_name}:
            problems.append(f"round {step}: reduce-scatter over {used}")
    # a buffer that shards over one rank (a (world, 1) HSDP mesh) given the world's group.
    # (Not a group of some ranks: new_group then registers a group on its members only, and
    # the hashed names of later local-synchronization groups differ across the ranks.)
    one = random_plan(random.Random(seed), 1)
    single = DBuffer.from_tensors(full_tensors(one, seed), one,
                                  device_mesh(world, 1, names=("rs_replicate", "rs_one")))
    try:
        single.set_reduce_scatter_group(group)
        problems.append("a group over other ranks was accepted")
    except ValueError as error:
        if "are not the shard group's" not in str(error):
            problems.append(str(error))
    return problems


def test_reduce_scatter_over_a_group_of_its_own(ranks) -> None:
    for problems in ranks.run(3, _separate_group_case, 11):
        assert problems == []


class _AllocatingBackend:
    """A backend with its own allocator (as NCCL's), recording what it allocated."""

    def __init__(self) -> None:
        self.allocated: list[tuple[int, torch.dtype]] = []

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return True

    def allocate_tensor(self, numel: int, *, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
        self.allocated.append((numel, dtype))
        return torch.empty(numel, dtype=dtype, device=device)


class _Group:
    def __init__(self, backend: _AllocatingBackend) -> None:
        self.backend = backend

    def _get_backend(self, device: torch.device) -> _AllocatingBackend:
        return self.backend


def test_group_memory_takes_the_backends_allocator_where_it_has_one() -> None:
    from dbuffer.collectives import GroupMemory

    backend = _AllocatingBackend()
    block = GroupMemory(_Group(backend)).allocate((3, 4), dtype=torch.bfloat16,
                                                  device=torch.device("cpu"))
    assert backend.allocated == [(12, torch.bfloat16)] and block.shape == (12,)


def _group_memory_case(seed: int) -> list[str]:
    """A buffer taking its collectives' memory from the process group (bf16 compute, fp32
    reduce): each buffer the collectives write or the reduce-scatter reads comes from
    ``GroupMemory`` (gloo has no allocator of its own, so ``torch.empty``), allocation by
    allocation, and the results equal the default's bit for bit."""
    from dbuffer.collectives import GroupMemory

    log: list[tuple[int, torch.dtype]] = []
    allocate = GroupMemory.allocate

    def recorded(self, size, *, dtype, device):
        log.append((size[0], dtype))
        return allocate(self, size, dtype=dtype, device=device)

    GroupMemory.allocate = recorded
    try:
        p = random_plan(random.Random(seed), dist.get_world_size())
        full = full_tensors(p, seed)
        names = [e.name for e in p.entries]
        problems = []
        kwargs = {"compute_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
        ours, ref = DBuffer.from_tensors(full, p, **kwargs), DBuffer.from_tensors(full, p, **kwargs)
        ours.set_group_memory(True)
        for step, async_op in enumerate((False, True)):
            (g1, r1), (g2, r2) = (_round(b, names, dist.get_rank(), step, async_op)
                                  for b in (ours, ref))
            if any(not torch.equal(g1[n], g2[n]) for n in names) or not torch.equal(r1, r2):
                problems.append(f"round {step}: differs from the default buffers")
        unsharded = p.world_size * p.shard_size
        steps = [("all-gather", ours.all_gather, [(unsharded, torch.bfloat16)])]
        if ours.trainable:
            steps += [("gradient buffer", lambda: ours.grad_view(ours.trainable[0]),
                       [(unsharded, torch.bfloat16)]),
                      ("reduce-scatter", lambda: ours.reduce_scatter(free_grad=True),
                       [(unsharded, torch.float32), (p.shard_size, torch.float32)])]
        for what, run, expected in steps:
            mark = len(log)
            run()
            if log[mark:] != expected:
                problems.append(f"{what}: allocated {log[mark:]} from the group, not {expected}")
        ours.set_group_memory(False)
        ours.free_unsharded()
        mark = len(log)
        ours.all_gather()
        if log[mark:]:
            problems.append("allocated from the group after set_group_memory(False)")
        return problems
    finally:
        GroupMemory.allocate = allocate


def test_group_memory_holds_the_collectives_buffers(ranks) -> None:
    for problems in ranks.run(3, _group_memory_case, 7):
        assert problems == []
