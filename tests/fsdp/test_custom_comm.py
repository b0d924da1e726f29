"""``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` side by side with FSDP2
on 3 gloo ranks: the same comm classes (FSDP2's ``AllGather`` / ``ReduceScatter``) run every
collective of both systems (counted), training matches one process on all ranks' data as
closely as FSDP2 does, and fsdp's unsharded parameters are views of the memory the comm
allocated (FSDP2 copies out of it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.comm_recorders import RecordingAllGather, RecordingReduceScatter
from tests.fsdp.models import full, import_fsdp
from tests.fsdp.test_all_reduce_hook import STEPS, _batch, _model


def _run(impl: str | None, mixed: bool) -> dict[str, Any]:
    model = _model()
    gather, scatter = RecordingAllGather(), RecordingReduceScatter()
    in_comm_memory: list[bool] = []
    if impl is not None:
        api = import_fsdp(impl)
        mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mixed else api.MixedPrecisionPolicy()
        for layer in (model[0], model[2]):
            api.fully_shard(layer, mp_policy=mp)
        api.fully_shard(model, mp_policy=mp)
        for module in (model, model[0], model[2]):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
        model[2].register_forward_pre_hook(
            lambda module, args: in_comm_memory.append(gather.last_holds(module.weight)))
    _train(model, impl is None)
    return {"params": {n: full(p) for n, p in model.named_parameters()},
            "calls": (gather.calls, len(scatter.ops)), "in_comm_memory": in_comm_memory}


def _train(model: torch.nn.Module, one_process: bool) -> None:
    """``STEPS`` AdamW steps on this rank's batches, or in one process on every rank's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        if one_process:
            loss = sum(model(_batch(step, r)).pow(2).mean() for r in range(world)) / world
        else:
            loss = model(_batch(step, rank)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _case(mixed: bool) -> dict[str, Any]:
    ref = _run(None, mixed)
    out: dict[str, Any] = {}
    for impl in ("torch", "fsdp"):
        got = _run(impl, mixed)
        out[impl] = {"error": max((got["params"][n] - ref["params"][n]).abs().max().item()
                                  for n in ref["params"]),
                     "calls": got["calls"], "in_comm_memory": got["in_comm_memory"]}
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_custom_collectives_run_every_gather_and_reduction(ranks, mixed: bool) -> None:
    for out in ranks.run(3, _case, mixed, timeout=300):
        fsdp, torch_ = out["fsdp"], out["torch"]
        assert fsdp["error"] <= max(2 * torch_["error"], 1e-5), out
        gathers, scatters = fsdp["calls"]
        assert gathers > 0 and scatters > 0
        assert fsdp["calls"] == torch_["calls"], out
        assert fsdp["in_comm_memory"] == [True] * STEPS, out


def _group_memory_run(impl: str | None) -> dict[str, Any]:
    """Training with ``set_allocate_memory_from_process_group_for_comm(True)`` on every
    module (gloo has no allocator of its own: both systems fall back to ``torch.empty``);
    for fsdp, how many buffers came through the group's allocator."""
    from dbuffer.collectives import GroupMemory

    model = _model()
    allocations = []
    allocate = GroupMemory.allocate

    def counted(self, size, *, dtype, device):
        allocations.append(size[0])
        return allocate(self, size, dtype=dtype, device=device)

    GroupMemory.allocate = counted
    try:
        if impl is not None:
            api = import_fsdp(impl)
            for layer in (model[0], model[2]):
                api.fully_shard(layer)
            api.fully_shard(model)
            for module in (model, model[0], model[2]):
                module.set_allocate_memory_from_process_group_for_comm(True)
        _train(model, impl is None)
    finally:
        GroupMemory.allocate = allocate
    # each buffer's all-gather output and gradient buffer (world x S), and its sharded
    # gradients (S), came through the group's allocator
    missing = []
    if impl == "fsdp":
        from fsdp.state import get_state

        for module in (model, model[0], model[2]):
            group = get_state(module).group
            for buffer in ([] if group is None else group.buffers):
                for numel in (buffer.world_size * buffer.shard_size, buffer.shard_size):
                    if numel not in allocations:
                        missing.append(numel)
    return {"params": {n: full(p) for n, p in model.named_parameters()},
            "allocations": len(allocations), "missing": missing}


def _group_memory_case() -> dict[str, Any]:
    ref = _group_memory_run(None)
    out: dict[str, Any] = {}
    for impl in ("torch", "fsdp"):
        got = _group_memory_run(impl)
        out[impl] = {"error": max((got["params"][n] - ref["params"][n]).abs().max().item()
                                  for n in ref["params"]),
                     "allocations": got["allocations"], "missing": got["missing"]}
        api = import_fsdp(impl)
        for setter, comm in (("set_custom_all_gather", RecordingAllGather()),
                             ("set_custom_reduce_scatter", RecordingReduceScatter())):
            model = _model()
            api.fully_shard(model)
            getattr(model, setter)(comm)
            try:
                model.set_allocate_memory_from_process_group_for_comm(True)
                out[impl][setter] = "no error"
            except AssertionError as error:
                out[impl][setter] = str(error)
    return out


def test_allocate_memory_from_process_group_trains_like_fsdp2(ranks) -> None:
    """fsdp takes each buffer's all-gather output, gradient buffer and sharded gradients
    from the process group's allocator (counted by size) and trains as close to one process
    as FSDP2 with the same call; with a custom all-gather or reduce-scatter set, both raise
    FSDP2's ``AssertionError``."""
    for out in ranks.run(3, _group_memory_case, timeout=300):
        fsdp, torch_ = out["fsdp"], out["torch"]
        assert fsdp["error"] <= max(2 * torch_["error"], 1e-5), out
        assert fsdp["allocations"] > 0 and fsdp["missing"] == [], out
        prefix = "cannot call set_allocate_memory_from_process_group() when "
        for impl in (fsdp, torch_):
            assert impl["set_custom_all_gather"] == (
                prefix + "all gather comm is custom: RecordingAllGather"), out
            assert impl["set_custom_reduce_scatter"] == (
                prefix + "reduce scatter comm is custom: RecordingReduceScatter"), out
