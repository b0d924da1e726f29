"""fsdp's machinery, counted and measured: collectives per step, zero copy, memory, lifetimes.

Each case trains the parity tests' tiny decoder (tied embedding and head, a frozen parameter
in the root group, a buffer per attention module) on gloo ranks and checks what the sharding
system does, not only what it computes: how many collectives each group issues, that the
tensors handed to them are DBuffer's own buffers, that no FSDP2-style copy op runs, and that
unsharded memory is released when a group reshards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tests.dbuffer.collective_log import record_collectives
from tests.fsdp.models import VOCAB, RunSpec, batches, build_model, shard
from tests.harness import device_mesh

FSDP2_COPY_OPS = ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat", "_foreach_copy_")


def _sharded_model(world: int, spec: RunSpec = RunSpec()) -> Any:
    model = build_model()
    shard(model, "fsdp", spec, device_mesh(world))
    return model


def _forward_backward(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = tokens.shape[0] // world
    mine = tokens[rank * per:(rank + 1) * per]
    loss = F.cross_entropy(model(mine[:, :-1]).float().reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def _step(model: Any, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    loss = _forward_backward(model, tokens)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _groups(model: Any) -> list[Any]:
    from fsdp.state import get_state

    states = []
    for m in model.modules():
        state = get_state(m)
        if state is not None and state not in states:
            states.append(state)
    return [g for s in states for g in s.groups]


def _count_collectives() -> dict[str, Any]:
    model = _sharded_model(dist.get_world_size())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = batches(RunSpec(steps=2, global_batch=2 * dist.get_world_size()))
    _step(model, optimizer, data[0])
    with record_collectives() as log:
        _step(model, optimizer, data[1])
    groups = _groups(model)
    forward = sum(len(g.buffers) for g in groups)
    backward = sum(len(g.buffers) for g in groups if g.config.reshard_after_forward)
    reduce = sum(len(g.trainable_buffers) for g in groups)
    names = [c.name for c in log]
    return {"all_gather": names.count("all_gather_single"),
            "reduce_scatter": names.count("reduce_scatter_single"),
            "other": sorted(n for n in names if n not in ("all_gather_single", "reduce_scatter_single")),
            "expected": (forward + backward, reduce),
            "buffers": [(g.label, len(g.buffers), len(g.trainable_buffers)) for g in groups]}


@pytest.mark.parametrize("world", [2, 3])
def test_one_all_gather_per_buffer_and_pass_and_one_reduce_scatter_per_group(ranks, world):
    for out in ranks.run(world, _count_collectives):
        # Every block is one buffer; the root holds the frozen position table in one and
        # its trainable parameters in two, cut where its blocks are (fsdp.backward_split):
        # the final norm, registered after them, and the tied embedding and head.
        assert out["buffers"] == [("TinyDecoder", 3, 2), ("Block", 1, 1), ("Block", 1, 1)]
        # blocks: forward + backward all-gather each; root: forward only (kept unsharded);
        # one reduce-scatter per trainable buffer; SGD on the sharded views needs none.
        assert out["expected"] == (2 * 2 + 3, 4)
        assert (out["all_gather"], out["reduce_scatter"]) == out["expected"]
        assert out["other"] == []


def _zero_copy_step() -> dict[str, Any]:
    model = _sharded_model(dist.get_world_size())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = batches(RunSpec(steps=2, global_batch=2 * dist.get_world_size()))
    _step(model, optimizer, data[0])
    groups = _groups(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_collectives() as log:
        _forward_backward(model, data[1])
        # the reduced gradients: memory owned by the parameters' .grad views alone
        sharded_grads = {p.grad.to_local().untyped_storage().data_ptr()
                         for p in model.parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    ops = {e.name for e in prof.events()}
    own: dict[str, set[int]] = {"sharded": set(), "unsharded": set(), "grad": set(),
                                "sharded_grad": sharded_grads}
    for g in groups:
        for b in g.buffers:
            own["sharded"].add(b.sharded_buffer.data_ptr())
            if b.is_unsharded:
                own["unsharded"].add(b.unsharded_buffer.data_ptr())
    return {"copy_ops": sorted(o for o in ops if any(c in o for c in FSDP2_COPY_OPS)),
            "calls": [(c.name, c.output, c.input) for c in log], "own": own}


@pytest.mark.parametrize("world", [2, 3])
def test_whole_step_is_zero_copy(ranks, world):
    for out in ranks.run(world, _zero_copy_step):
        assert out["copy_ops"] == []
        own = out["own"]
        for name, output, inp in out["calls"]:
            if name == "all_gather_single":
                # input: the sharded buffer itself (no copy-in); output: an unsharded buffer
                # (the same address every gather, since DBuffer restores storage in place)
                assert inp in own["sharded"], (name, inp)
            elif name == "reduce_scatter_single":
                assert output in own["sharded_grad"], (name, output)
        gathers = [o for n, o, _ in out["calls"] if n == "all_gather_single"]
        assert gathers and {o for o in gathers} >= own["unsharded"]


def _memory_trace() -> dict[str, Any]:
    from fsdp import param_group

    model = _sharded_model(dist.get_world_size())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    groups = _groups(model)
    root = groups[0]
    peaks: list[int] = []
    original = param_group.FSDPParamGroup.wait_for_unshard

    def traced(self: Any) -> None:
        original(self)
        peaks.append(sum(1 for g in groups if g is not root and any(
            b.is_unsharded for b in g.buffers)))

    param_group.FSDPParamGroup.wait_for_unshard = traced
    try:
        data = batches(RunSpec(steps=3, global_batch=2 * dist.get_world_size()))
        for tokens in data:
            _step(model, optimizer, tokens)
    finally:
        param_group.FSDPParamGroup.wait_for_unshard = original
    freed = [b.unsharded_buffer.untyped_storage().nbytes() if b.is_unsharded else 0
             for g in groups if g is not root for b in g.buffers]
    return {"peak_groups": max(peaks), "freed_after_step": freed,
            "grad_memory_after_step": [b.has_grad for g in groups for b in g.buffers]}


def test_unsharded_memory_holds_at_most_current_and_prefetched_group(ranks):
    for out in ranks.run(2, _memory_trace):
        assert 1 <= out["peak_groups"] <= 2
        assert out["freed_after_step"] == [0, 0]
        assert not any(out["grad_memory_after_step"])


def _prefetch_timing(start: str | None) -> dict[str, Any]:
    """Each backward prefetch, with how many gradients the group whose backward runs (the
    last to compute one) had computed then, out of its trainable parameters, and whether a
    gradient hook issued it (``start``: the ``set_backward_prefetch_start`` argument, ``None``
    for the default)."""
    from fsdp import param_group, state

    counts: dict[int, int] = {}
    current: list[Any] = [None]
    in_grad_hook = [False]
    prefetches: list[tuple[int, int | None, int, int, bool]] = []
    accumulated = param_group.FSDPParamGroup.grad_accumulated
    prefetch = state._prefetch_for_backward

    def traced_grad(self: Any, param: Any) -> None:
        if current[0] is not self:
            current[0], counts[id(self)] = self, 0
        counts[id(self)] += 1
        in_grad_hook[0] = True
        try:
            accumulated(self, param)
        finally:
            in_grad_hook[0] = False

    def traced_prefetch(group: Any) -> None:
        running = current[0]
        prefetches.append((id(group), None, 0, 0, in_grad_hook[0]) if running is None else (
            id(group), id(running), counts[id(running)],
            sum(p.trainable for p in running.params), in_grad_hook[0]))
        prefetch(group)

    # patched before the model exists: each parameter binds its group's grad_accumulated
    param_group.FSDPParamGroup.grad_accumulated = traced_grad
    state._prefetch_for_backward = traced_prefetch
    try:
        model = _sharded_model(dist.get_world_size())
        if start is not None:
            model.set_backward_prefetch_start(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for tokens in batches(RunSpec(steps=2, global_batch=2 * dist.get_world_size())):
            current[0] = None
            _step(model, optimizer, tokens)
    finally:
        param_group.FSDPParamGroup.grad_accumulated = accumulated
        state._prefetch_for_backward = prefetch
    return {"prefetches": prefetches}


def test_backward_prefetch_waits_for_half_of_the_current_groups_gradients(ranks):
    """The next group's all-gather starts in the middle of the current group's backward, not
    at its pre-backward (when its activations are all alive and its gradient buffer is being
    allocated): every backward prefetch comes after half of the running group's gradients."""
    for out in ranks.run(2, _prefetch_timing, None):
        assert out["prefetches"], out
        for target, running, seen, trainable, from_grad_hook in out["prefetches"]:
            assert running is not None and running != target, out
            assert seen >= (trainable + 1) // 2 and from_grad_hook, out


def test_backward_prefetch_at_pre_backward_when_asked(ranks):
    """``set_backward_prefetch_start("pre_backward")``: as many prefetches, each issued by a
    pre-backward hook or, while a reduce-scatter is in flight, at the running group's first
    gradient; a bad argument raises naming it."""
    for out, default in zip(ranks.run(2, _prefetch_timing, "pre_backward"),
                            ranks.run(2, _prefetch_timing, None)):
        assert out["prefetches"] and len(out["prefetches"]) == len(default["prefetches"])
        # at the pre-backward, or at the running group's first gradient when a reduce-scatter
        # was in flight then
        assert all(not hook or seen == 1 for _, _, seen, _, hook in out["prefetches"]), out
        assert not all(hook for *_, hook in out["prefetches"]), out
    for message in ranks.run(2, _bad_prefetch_start):
        assert "when must be 'half_gradients' or 'pre_backward', got 'post_backward'" in message


def _bad_prefetch_start() -> str:
    model = _sharded_model(dist.get_world_size())
    with pytest.raises(ValueError) as raised:
        model.set_backward_prefetch_start("post_backward")
    return str(raised.value)


def _frozen_and_tied() -> dict[str, Any]:
    model = _sharded_model(dist.get_world_size())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    tokens = batches(RunSpec(steps=1, global_batch=2 * dist.get_world_size()))[0]
    rank, per = dist.get_rank(), 2
    mine = tokens[rank * per:(rank + 1) * per]
    F.cross_entropy(model(mine[:, :-1]).float().reshape(-1, VOCAB), mine[:, 1:].reshape(-1)).backward()
    root = _groups(model)[0]
    frozen = [b for b in root.buffers if not b.trainable]
    out = {"pos_grad": model.pos.grad is None, "frozen_has_grad_memory": [b.has_grad for b in frozen],
           "tied_same_object": model.head.weight is model.embed.weight,
           "tied_grad": model.embed.weight.grad is not None,
           "params_are_ragged": all(type(p.placements[-1]).__name__ == "RaggedShard"
                                    for p in model.parameters())}
    optimizer.step()
    return out


def test_frozen_parameters_get_no_gradient_memory_and_tied_weights_stay_one(ranks):
    for out in ranks.run(2, _frozen_and_tied):
        assert out == {"pos_grad": True, "frozen_has_grad_memory": [False],
                       "tied_same_object": True, "tied_grad": True, "params_are_ragged": True}


def _state_dict_is_local() -> dict[str, Any]:
    model = _sharded_model(dist.get_world_size())
    tokens = batches(RunSpec(steps=1, global_batch=2))[0][:, :-1]
    model(tokens)  # the root keeps its parameters unsharded after forward
    with record_collectives() as log:
        sd = model.state_dict()
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    saved = {k: v.to_local().clone() for k, v in sd.items() if hasattr(v, "to_local")}
    copies = {k: v.clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(copies)
    restored = all(torch.equal(model.state_dict()[k].to_local(), v) for k, v in saved.items())
    return {"collectives": len(log), "dtensors": len(saved), "params": len(names),
            "restored": restored}


def test_state_dict_gives_the_sharded_parameters_with_no_communication(ranks):
    for out in ranks.run(2, _state_dict_is_local):
        assert out["collectives"] == 0
        assert out["dtensors"] == out["params"]
        assert out["restored"]
