"""Expert parallelism composed with fsdp, the torchtitan layout, on 4 gloo ranks: a mixture of
experts whose fused 3-D expert stacks are ``Shard(0)`` over a 2-rank EP mesh dim, tokens sent
to the rank holding their expert and back with an all-to-all, the experts sharded by fsdp
over the data-parallel dim (whole experts per rank: a unit is one expert) and everything else
over all four ranks. Side by side with FSDP2 on the same layout; both against one process on
the global batch (every rank's tokens, every expert local).

Two ways to say it, both as FSDP2 takes them: the experts in a ``fully_shard`` group of their
own over the dp mesh, or one group for the whole model whose ``shard_placement_fn`` returns a
``ShardPlacementResult`` on the dp mesh for the experts (torch 2.13's per-parameter meshes, the
pattern of FSDP2's ``test_shard_placement_fn_tp_ep``): the group then holds buffers of both
meshes; with ``reshard_after_forward=2`` too, the dense buffers keeping pieces for 2-rank
gathers and the experts' (over 2 ranks already) resharding fully. Also as that test does
it with HSDP: the dense parameters over a 2 x 2
``(dp_replicate, dp_shard)`` mesh, ``dp_shard`` unflattened into ``(efsdp, ep)``, the experts
over ``(dp_replicate, efsdp)`` (2 x 1).

The model is written here; its MoE layer and the EP wrapping (stacks distributed, token
all-to-all) are the main job's (``examples/train/moe.py``, ``expert_parallel`` in
``examples/train/parallelize.py``), so this test also checks the code the job runs."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.train.moe import MoE
from examples.train.parallelize import expert_parallel
from tests.fsdp.models import full, import_fsdp
from tests.fsdp.test_mechanics import _groups
from tests.harness import device_mesh

DIM, HIDDEN, EXPERTS, TOKENS, STEPS = 12, 20, 4, 9, 4
STACKS = ("w1", "w3", "w2")


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.proj_in = nn.Linear(DIM, DIM)
        self.moe = MoE(DIM, HIDDEN, EXPERTS, top_k=1)
        self.proj_out = nn.Linear(DIM, 5)
        for name in ("w1", "w3", "w2"):
            stack = getattr(self.moe.experts, name)
            nn.init.normal_(stack, std=stack.shape[-1] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj_in(x))
        return self.proj_out(h + self.moe(h))


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


@functools.cache
def _expert_mesh_info(mesh: Any) -> Any:
    """FSDP2's description of the experts' mesh (HSDP for a 2-D one), one object per mesh
    (FSDP2 compares them by identity)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    if mesh.ndim == 2:
        return HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    return FSDPMeshInfo(mesh=mesh, shard_mesh_dim=0)


def _shard(api: Any, model: nn.Module, pattern: str, world: int) -> None:
    """Experts Shard(0) over a 2-rank EP dim and fsdp over the data-parallel ranks, by
    ``pattern``: two groups, or one group whose ShardPlacementResult puts the experts on the
    EP dim's data-parallel partner (1-D, or HSDP 2 x 1 beside a 2 x 2 HSDP dense mesh)."""
    if pattern == "groups":
        mesh = device_mesh(2, 2, names=("dp", "ep"))
        (experts,) = expert_parallel(model, mesh["ep"])
        api.fully_shard(experts, mesh=mesh["dp"])
        # an expert's gradient gathers every rank's tokens through the all-to-all: summed
        # over dp it holds all four ranks' contributions, so it is averaged over all four
        experts.set_gradient_divide_factor(float(world))
        experts.set_force_sum_reduction_for_comms(True)  # FSDP2's PREMUL_SUM: no gloo kernel
        api.fully_shard(model, mesh=device_mesh(world, names=("dp_ep",)))
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.tensor import Shard

    if pattern.startswith("placement_result") and not pattern.endswith("hsdp"):
        mesh = device_mesh(2, 2, names=("dp", "ep"))
        dense, ep, expert_mesh = device_mesh(world, names=("dp_ep",)), mesh["ep"], mesh["dp"]
    else:  # FSDP2's dp_replicate case: dp_shard unflattened into (efsdp, ep)
        dense = device_mesh(2, 2, names=("dp_replicate", "dp_shard"))
        sparse = dense._unflatten(1, (1, 2), ("efsdp", "ep"))
        ep, expert_mesh = sparse["ep"], sparse["dp_replicate", "efsdp"]
    (experts,) = expert_parallel(model, ep)
    stacks = set(experts.parameters())

    def placement(param: nn.Parameter) -> Any:
        if param in stacks:
            return ShardPlacementResult(Shard(0), _expert_mesh_info(expert_mesh))
        return None

    # "_reshard2": after forward the dense buffers keep pieces for 2-rank gathers; the
    # experts' buffers shard over 2 ranks already, so they reshard fully
    reshard = 2 if pattern.endswith("reshard2") else None
    api.fully_shard(model, mesh=dense, shard_placement_fn=placement,
                    reshard_after_forward=reshard)
    # one divide factor for the group: all four ranks for the dense parameters and, as
    # above, for the experts
    model.set_gradient_divide_factor(float(world))
    model.set_force_sum_reduction_for_comms(True)


def _run(impl: str | None, pattern: str = "groups") -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Model()
    if impl is not None:
        _shard(import_fsdp(impl), model, pattern, world)
    # after each forward, which buffers hold pieces for a smaller group's gather (fsdp)
    pieces: list[list[bool]] = []
    if impl == "fsdp":
        model.register_forward_hook(lambda *_: pieces.append(
            [b.piece_numel > 0 for g in _groups(model) for b in g.buffers]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if impl is None:
            batch = torch.cat([_tokens(step, r) for r in range(world)])
        else:
            batch = _tokens(step, rank)
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    if impl is not None:
        for loss in losses:
            dist.all_reduce(loss)
            loss /= world
    params = {n: full(p) for n, p in model.named_parameters()}
    # elements of each expert stack this rank holds (a ragged run of its EP-local experts)
    held = ([getattr(model.moe.experts, n).to_local().numel() for n in STACKS]
            if impl == "fsdp" else None)
    # the meshes each fsdp group's buffers gather and reduce over
    meshes = ([sorted({b.topology.mesh.mesh_dim_names for b in g.buffers}) for g in _groups(model)]
              if impl == "fsdp" else None)
    return {"losses": torch.stack(losses), "params": params, "held": held, "meshes": meshes,
            "pieces": pieces[-1] if pieces else None,
            "piece_meshes": ([b.topology.mesh.mesh_dim_names for g in _groups(model)
                              for b in g.buffers] if impl == "fsdp" else None)}


def _case(pattern: str) -> dict[str, Any]:
    ref = _run(None)
    out: dict[str, Any] = {}
    for impl in ("torch", "fsdp"):
        got = _run(impl, pattern)
        out[impl] = {
            "loss": (got["losses"] - ref["losses"]).abs().max().item(),
            "param": max((got["params"][n] - ref["params"][n]).abs().max().item()
                         for n in ref["params"]),
            "held": got["held"],
            "meshes": got["meshes"],
            "pieces": got["pieces"],
            "piece_meshes": got["piece_meshes"],
        }
    return out


@pytest.mark.parametrize("pattern", ["groups", "placement_result", "placement_result_reshard2",
                                     "placement_result_hsdp"])
def test_experts_over_ep_and_fsdp_train_like_one_process(ranks, pattern: str) -> None:
    ranks_out = ranks.run(4, _case, pattern, timeout=300)
    for out in ranks_out:
        ours, theirs = out["fsdp"], out["torch"]
        if pattern.endswith("hsdp"):
            # FSDP2 (torch 2.13) is no oracle here: its experts end up to 3.4e-3 off one
            # process's (dense parameters 1.4e-5); hold fsdp to one process directly, as
            # close as FSDP2 gets on the other patterns
            assert ours["loss"] <= 1e-5 and ours["param"] <= 1e-6, out
            continue
        assert theirs["param"] < 1e-4, out  # the layout and the divide factor are right
        assert ours["loss"] <= max(2 * theirs["loss"], 1e-5), out
        assert ours["param"] <= max(2 * theirs["param"], 1e-5), out
    # one group per mesh, or one group holding buffers of both
    expected = {"groups": [[("dp_ep",)], [("dp",)]],
                "placement_result": [[("dp",), ("dp_ep",)]],
                "placement_result_reshard2": [[("dp",), ("dp_ep",)]],
                "placement_result_hsdp": [[("dp_replicate", "dp_shard"),
                                           ("dp_replicate", "efsdp")]]}[pattern]
    assert all(out["fsdp"]["meshes"] == expected for out in ranks_out), ranks_out[0]
    # reshard_after_forward=2: the dense buffers (over all four ranks) keep pieces for a
    # 2-rank gather, the experts' (over 2 ranks already) none
    if pattern.endswith("reshard2"):
        for out in ranks_out:
            ours = out["fsdp"]
            assert ours["pieces"] == [m == ("dp_ep",) for m in ours["piece_meshes"]], ours
    # each EP rank's 2 experts per stack are cut over the 2 dp ranks, whole experts only (HSDP:
    # one shard rank, which holds both)
    shard_groups = ((0,), (1,), (2,), (3,)) if pattern.endswith("hsdp") else ((0, 2), (1, 3))
    for ranks_of_shard in shard_groups:
        for stack in range(len(STACKS)):
            runs = [ranks_out[r]["fsdp"]["held"][stack] for r in ranks_of_shard]
            assert sum(runs) == 2 * DIM * HIDDEN, ranks_out
            assert all(run % (DIM * HIDDEN) == 0 for run in runs), ranks_out
