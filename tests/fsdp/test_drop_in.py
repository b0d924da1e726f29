"""fsdp is a drop-in for FSDP2: the same training function, only the import changed.

:func:`train_with` is written as a user would write it against torch 2.13's FSDP2; the test
runs it once with ``fully_shard`` / ``MixedPrecisionPolicy`` taken from
``torch.distributed.fsdp`` and once from ``fsdp``. The losses must agree as closely as FSDP2
agrees with one process in the fp32 parity tests (1e-5), and the fsdp run's parameters, as
seen through ``named_parameters()`` and ``state_dict()``, must be DTensors placed with
``RaggedShard`` (FSDP2's are ``Shard(0)``) under the unwrapped model's names.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from tests.fsdp.models import SEQ, VOCAB, RunSpec, batches, build_model
from tests.harness import RankPools, device_mesh

WORLD_SIZES = (2, 3)
STEPS = 5


def train_with(fsdp_module: str) -> dict[str, Any]:
    """Shard, train with AdamW for a few steps, describe what the model exposes."""
    api = importlib.import_module(fsdp_module)  # the one line a user changes
    fully_shard, MixedPrecisionPolicy = api.fully_shard, api.MixedPrecisionPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    names = list(model.state_dict())
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=device_mesh(world), mp_policy=policy)
    fully_shard(model, mesh=device_mesh(world), mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    losses = []
    per_rank = 12 // world
    for tokens in batches(RunSpec(steps=STEPS)):
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        logits = model(mine[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)

    state = model.state_dict()
    return {
        "losses": losses,
        "names": names,
        "state_dict_names": list(state),
        "model_class": type(model).__name__,
        "is_fsdp_module": isinstance(model, api.FSDPModule),
        "params": {n: _describe(p) for n, p in model.named_parameters()},
        "state_dict": {n: _describe(t) for n, t in state.items()},
        "buffer_is_plain": type(state["layers.0.attn.causal"]) is torch.Tensor
        and state["layers.0.attn.causal"].shape == (SEQ, SEQ),
        "grad_free": all(p.grad is None for p in model.parameters()),
    }


def _describe(t: torch.Tensor) -> dict[str, Any]:
    from ragged_dtensor import is_ragged

    dtensor = isinstance(t, DTensor)
    return {"dtensor": dtensor, "ragged": is_ragged(t),
            "shard0": dtensor and tuple(t.placements) == (Shard(0),),
            "parameter": isinstance(t, torch.nn.Parameter)}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_same_training_code_runs_on_fsdp(ranks, world_size: int) -> None:
    import fsdp

    assert fsdp.MixedPrecisionPolicy is torch.distributed.fsdp.MixedPrecisionPolicy
    theirs = ranks.run(world_size, train_with, "torch.distributed.fsdp")[0]
    ours = ranks.run(world_size, train_with, "fsdp")[0]

    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) <= 1e-5
    for run in (ours, theirs):
        assert run["model_class"] == "FSDPTinyDecoder" and run["is_fsdp_module"]
        assert run["state_dict_names"] == run["names"]
        assert run["buffer_is_plain"] and run["grad_free"]
        assert sorted(run["params"]) == sorted(n for n in run["names"]
                                               if n not in ("head.weight", "layers.0.attn.causal",
                                                            "layers.1.attn.causal"))
    for kind in ("params", "state_dict"):
        tensors = {n: d for n, d in ours[kind].items() if "causal" not in n}
        assert all(d["dtensor"] and d["ragged"] and not d["shard0"] for d in tensors.values()), \
            tensors
        assert all(d["parameter"] for n, d in ours["params"].items())
        oracle = {n: d for n, d in theirs[kind].items() if "causal" not in n}
        assert all(d["shard0"] and not d["ragged"] for d in oracle.values()), oracle


def private_state_with(fsdp_module: str) -> dict[str, Any]:
    """What code written against FSDP2's private state reads (its own tests, debugging
    helpers): root flags, the states' order, group and parameter names, which modules of a
    list group still have to run forward, and whether a group is unsharded."""
    api = importlib.import_module(fsdp_module)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
        torch.nn.Linear(8, 8))
    api.fully_shard(model[0][0], mesh=device_mesh(world))
    api.fully_shard([model[1][0], model[1][1]], mesh=device_mesh(world),
                    reshard_after_forward=False)
    api.fully_shard(model, mesh=device_mesh(world))
    states = {name: api.fully_shard.state(module) for name, module in
              (("root", model), ("first", model[0][0]), ("list", model[1][0]))}
    root = states["root"]
    root._lazy_init()

    def group(state: Any) -> Any:
        return None if state._fsdp_param_group is None else (
            state._fsdp_param_group._module_fqn,
            sorted(p._param_fqn for p in state._fsdp_param_group.fsdp_params))

    names = {id(s): n for n, s in states.items()}
    seen: dict[str, Any] = {
        "is_root": {n: s._is_root for n, s in states.items()},
        "all_states": [names.get(id(s)) for s in root._state_ctx.all_states],
        "groups": {n: group(s) for n, s in states.items()},
        "to_run_before": {n: len(s._modules_to_run_forward) for n, s in states.items()}}
    model(torch.randn(2, 8)).sum().backward()
    seen["to_run_after"] = {n: len(s._modules_to_run_forward) for n, s in states.items()}
    model[1][0](torch.randn(2, 8))  # one module of the list group runs alone
    seen["to_run_partial"] = len(states["list"]._modules_to_run_forward)
    seen["unsharded"] = {n: s._fsdp_param_group.is_unsharded for n, s in states.items()}
    return seen


def test_fsdp2_private_state_names_read_as_on_fsdp2(ranks) -> None:
    theirs = ranks.run(2, private_state_with, "torch.distributed.fsdp")[0]
    ours = ranks.run(2, private_state_with, "fsdp")[0]
    assert theirs["is_root"] == {"root": True, "first": False, "list": False}
    assert theirs["groups"]["list"] == ("1.0, 1.1", ["1.0.bias", "1.0.weight", "1.1.bias",
                                                     "1.1.weight"])
    assert theirs["to_run_partial"] == 1
    assert ours == theirs


def pipeline_stages_with(fsdp_module: str, share: bool) -> dict[str, Any]:
    """Two roots on one rank (pipeline stages), joined by ``share_comm_ctx`` where ``share``,
    trained as a pipeline schedule does (both forwards, then the last stage's backward, then
    the first's), and the list check on a module that is not sharded."""
    from torch import nn

    api = importlib.import_module(fsdp_module)
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2)]
    for stage in stages:
        api.fully_shard(stage[0])
        api.fully_shard(stage)
    api.share_comm_ctx([])
    if share:
        api.share_comm_ctx(stages)
    optim = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(3):
        hidden = stages[0](torch.randn(4, 8))
        boundary = hidden.detach().requires_grad_()
        loss = stages[1](boundary).pow(2).sum()
        loss.backward()
        hidden.backward(boundary.grad)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    try:
        api.share_comm_ctx([stages[0], nn.Linear(2, 2)])
        error = "no error"
    except ValueError as caught:
        error = str(caught)
    return {"losses": losses, "error": error.split(" but got")[0]}


def test_share_comm_ctx_joins_pipeline_stages_as_on_fsdp2(ranks) -> None:
    """Against FSDP2 with the stages apart: with them joined, FSDP2 (torch 2.13) raises an
    IndexError in the first stage's backward, where this schedule runs it after the last
    stage's (their shared post-forward order was cleared at the end of that backward)."""
    theirs = ranks.run(2, pipeline_stages_with, "torch.distributed.fsdp", False)[0]
    ours = ranks.run(2, pipeline_stages_with, "fsdp", True)[0]
    assert ours["error"] == theirs["error"] == "Expects list of FSDPModules"
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)


def _separate_reduce_scatter(impl: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """FSDP2's experimental reduce-scatter knobs, as a user sets them, then training; with
    fsdp, which groups each step's collectives ran over."""
    from tests.dbuffer.collective_log import record_collectives

    api = importlib.import_module(impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ("rs_replicate", "rs_shard") if len(mesh_shape) == 2 else ("rs_world",)
    mesh = device_mesh(*mesh_shape, names=names)
    model = build_model()
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    errors = []
    for bad in (0, True):
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    model.set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group()
    model.set_separate_reduce_scatter_group()  # again: keeps the groups it made
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    per_rank = 12 // world
    losses, logs = [], []
    for step, tokens in enumerate(batches(RunSpec(steps=4))):
        if step == 3:
            model.set_separate_reduce_scatter_group(False)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        with record_collectives() as log:
            loss = F.cross_entropy(model(mine[:, :-1]).reshape(-1, VOCAB),
                                   mine[:, 1:].reshape(-1))
            loss.backward()
        logs.append({(c.name, c.group_name) for c in log
                     if c.name in ("all_gather_single", "reduce_scatter_single")})
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    return {"losses": losses, "errors": errors, "logs": logs if impl == "fsdp" else None}


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)], ids=["w3", "hsdp2x2"])
def test_separate_reduce_scatter_group_and_input_buffers_as_on_fsdp2(mesh_shape) -> None:
    """In fresh rank processes: FSDP2 and fsdp make these groups with local synchronisation,
    and torch names such a group by hashing its ranks with the count of groups this rank
    holds, so a worker whose earlier tests left different counts on different ranks (a group
    made on some ranks only) would wait for a group name the others never use."""
    world = 1
    for size in mesh_shape:
        world *= size
    fresh = RankPools()
    try:
        ours = fresh.run(world, _separate_reduce_scatter, "fsdp", mesh_shape)
        theirs = fresh.run(world, _separate_reduce_scatter, "torch.distributed.fsdp", mesh_shape)
    finally:
        fresh.close()
    for mine, fsdp2 in zip(ours, theirs):
        assert mine["errors"] == fsdp2["errors"] and len(mine["errors"]) == 2, mine["errors"]
        assert mine["losses"] == pytest.approx(fsdp2["losses"], rel=1e-5, abs=1e-6)
        for step, calls in enumerate(mine["logs"]):
            gathers = {g for name, g in calls if name == "all_gather_single"}
            scatters = {g for name, g in calls if name == "reduce_scatter_single"}
            assert len(gathers) == 1 and len(scatters) == 1, calls  # one group each
            # a group of their own for the reduce-scatters, until switched back at step 3
            assert (gathers == scatters) is (step == 3), (step, calls)
