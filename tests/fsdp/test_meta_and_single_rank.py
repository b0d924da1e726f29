"""Meta-device parameters stay on meta until ``to_empty``; one-rank groups issue no collective.

* After ``fully_shard`` on the meta device every parameter reports ``is_meta`` as under FSDP2
  (code that initialises "what is still on meta" must find them) and its DBuffer holds no
  memory; ``to_empty`` allocates it; a model with a real block and a meta head initialises
  only the head, like FSDP2, and trains like one process.
* At world size 1, and on a 2-D mesh with a dimension of size 1, training issues no
  collective over the size-1 dimension (FSDP2 issues none at world size 1, counted in the same
  test), with the same parameters as one process / FSDP2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.dbuffer.collective_log import record_collectives
from tests.fsdp.models import full, import_fsdp
from tests.harness import device_mesh

COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_reduce")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)  # two rows: a rank of three owns none of the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(x)))


def _real_block_meta_head() -> Net:
    torch.manual_seed(0)
    model = Net()
    with torch.device("meta"):
        model.head = nn.Linear(6, 2)
    return model


def _init_head(head: nn.Module) -> None:
    torch.manual_seed(1)
    head.reset_parameters()


def _meta_flow(impl: str) -> dict[str, Any]:
    api = import_fsdp(impl)
    mesh = device_mesh(dist.get_world_size())
    model = _real_block_meta_head()
    api.fully_shard(model.block, mesh=mesh)
    api.fully_shard(model.head, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    out: dict[str, Any] = {
        "meta": sorted(n for n, p in model.named_parameters() if p.is_meta),
        "local_meta": sorted(n for n, p in model.named_parameters() if p.to_local().is_meta)}
    if impl == "fsdp":
        from tests.fsdp.test_mechanics import _groups

        out["meta_buffers"] = sorted(str(b.device) for g in _groups(model) for b in g.buffers)
    for name, module in model.named_children():  # initialise what is still on meta
        if any(p.is_meta for p in module.parameters()):
            module.to_empty(device="cpu")
            _init_head(module)
    out["after"] = [n for n, p in model.named_parameters() if p.is_meta]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        model(torch.randn(4, 6, generator=g)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: full(p) for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_meta_parameters_stay_on_meta_until_to_empty(ranks, world: int) -> None:
    reference = _real_block_meta_head()
    reference.head = nn.Linear(6, 2)
    _init_head(reference.head)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    for _ in range(2):
        (sum(reference(torch.randn(4, 6, generator=g)).square().sum() for g in gens)
         / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    theirs = ranks.run(world, _meta_flow, "torch")[0]
    for ours in ranks.run(world, _meta_flow, "fsdp"):
        assert ours["meta"] == theirs["meta"] == ["head.bias", "head.weight"]
        assert ours["local_meta"] == theirs["local_meta"]
        # the head's DBuffer held no memory before to_empty (the root owns no parameter)
        assert ours["meta_buffers"] == ["cpu", "meta"]
        assert ours["after"] == theirs["after"] == []
        for name, ref in reference.named_parameters():
            torch.testing.assert_close(ours["params"][name], ref.detach(), rtol=1e-6,
                                       atol=1e-6, msg=name)


def _meta_memory() -> dict[str, Any]:
    import fsdp
    from tests.fsdp.test_mechanics import _groups

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    fsdp.fully_shard(model, mesh=device_mesh(dist.get_world_size()))
    buffers = [b for g in _groups(model) for b in g.buffers]
    before = [(str(b.device), b.sharded_buffer.is_meta) for b in buffers]
    model.to_empty(device="cpu")
    after = [(str(b.device), b.sharded_buffer.untyped_storage().nbytes() > 0)
             for g in _groups(model) for b in g.buffers]
    return {"before": before, "after": after}


def test_meta_buffers_allocate_at_to_empty(ranks) -> None:
    for out in ranks.run(2, _meta_memory):
        assert out["before"] == [("meta", True)]
        assert out["after"] == [("cpu", True)]


def _load_into_meta(impl: str, weights: dict[str, torch.Tensor] | None,
                    partial: bool) -> dict[str, Any]:
    """A meta model loaded by ``set_model_state_dict`` (full state dict broadcast from rank 0)
    with no ``to_empty``: torch assigns the loaded DTensors to the meta parameters. With
    ``partial`` the head's bias is left out of the state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    api = import_fsdp(impl)
    mesh = device_mesh(dist.get_world_size())
    with torch.device("meta"):
        model = Net()
    api.fully_shard(model.block, mesh=mesh)
    api.fully_shard(model.head, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    # torch's loader replaces the entries of the dict it is given: each run gets its own
    weights = {k: v.clone() for k, v in (weights or {}).items()
               if not partial or k != "head.bias"}  # partial: the head's bias stays on meta
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, weights or {}, options=options)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(9))
    if partial:
        errors = []
        for run in (model.head.unshard, lambda: model(x)):  # explicit unshard, then forward
            try:
                run()
            except RuntimeError as error:
                errors.append(str(error))
        return {"errors": errors}
    out = model(x)
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "out": out.detach()}


def _load_case(source: dict[str, torch.Tensor]) -> dict[str, Any]:
    weights = source if dist.get_rank() == 0 else None
    return {impl: _load_into_meta(impl, weights, partial=False) for impl in ("torch", "fsdp")} | {
        "partial": _load_into_meta("fsdp", weights, partial=True)}


@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_loads_into_a_meta_model_without_to_empty(ranks, world: int) -> None:
    torch.manual_seed(4)
    reference = Net()
    source = {k: v.clone() for k, v in reference.state_dict().items()}
    expected = reference(torch.randn(3, 6, generator=torch.Generator().manual_seed(9))).detach()
    for out in ranks.run(world, _load_case, source):
        for impl in ("torch", "fsdp"):
            torch.testing.assert_close(out[impl]["params"], source, rtol=0, atol=0)
            torch.testing.assert_close(out[impl]["out"], expected, rtol=0, atol=1e-6)
        assert out["partial"]["errors"] == [
            "fsdp: parameters of Linear were assigned real values, but these are still on the "
            "meta device: bias; assign them all, or call model.to_empty(device=...) first",
            "FSDP parameters should be materialized from meta device before training, but the "
            "following were still on meta device: ['head.bias']\nFor example, call "
            "module.to_empty(device) to materialize to device and call "
            "module.reset_parameters() on each module to initialize values."]


def _train_counting(impl: str, shape: tuple[int, ...]) -> dict[str, Any]:
    api = import_fsdp(impl)
    mesh = device_mesh(*shape, names=("replicate", "shard") if len(shape) == 2 else None)
    torch.manual_seed(0)
    model = Net()
    api.fully_shard(model.block, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    with record_collectives() as log:
        for _ in range(2):
            model(torch.randn(4, 6, generator=g)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    names = [c.name for c in log]
    return {"counts": {n: names.count(n) for n in COLLECTIVES if names.count(n)},
            "params": {n: full(p) for n, p in model.named_parameters()}}


def test_world_size_one_issues_no_collective(ranks) -> None:
    torch.manual_seed(0)
    reference = Net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        reference(torch.randn(4, 6, generator=g)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    ours = ranks.run(1, _train_counting, "fsdp", (1,))[0]
    theirs = ranks.run(1, _train_counting, "torch", (1,))[0]
    assert ours["counts"] == theirs["counts"] == {}
    for name, ref in reference.named_parameters():
        assert torch.equal(ours["params"][name], ref.detach()), name


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_size_one_mesh_dimension_trains_without_its_collectives(ranks, shape) -> None:
    ours = ranks.run(2, _train_counting, "fsdp", shape)[0]
    theirs = ranks.run(2, _train_counting, "torch", shape)[0]
    if shape == (1, 2):  # plain FSDP over two ranks: no replicate all-reduce
        assert set(ours["counts"]) == {"all_gather_single", "reduce_scatter_single"}
    else:  # one shard per replica: only the replicate all-reduce
        assert set(ours["counts"]) == {"all_reduce"}
    for name, value in theirs["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=1e-6, atol=1e-6, msg=name)
