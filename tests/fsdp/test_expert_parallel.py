"""Expert parallelism composed with fsdp, the torchtitan layout, on 4 gloo ranks: a mixture of
experts whose fused 3-D expert stacks are ``Shard(0)`` over a 2-rank EP mesh dim, tokens sent
to the rank holding their expert and back with an all-to-all, the experts sharded by fsdp
over the data-parallel dim (whole experts per rank: a unit is one expert) and everything else
over all four ranks. Side by side with FSDP2 on the same layout; both against one process on
the global batch (every rank's tokens, every expert local).

The model is written here; its MoE layer and the EP wrapping (stacks distributed, token
all-to-all) are the main job's (``examples/train/moe.py``, ``expert_parallel`` in
``examples/train/parallelize.py``), so this test also checks the code the job runs."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from examples.train.moe import MoE
from examples.train.parallelize import expert_parallel
from tests.fsdp.models import full, import_fsdp
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


def _run(impl: str | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Model()
    if impl is not None:
        api = import_fsdp(impl)
        mesh = device_mesh(2, 2, names=("dp", "ep"))
        everyone = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_ep",))
        (experts,) = expert_parallel(model, mesh["ep"])
        api.fully_shard(experts, mesh=mesh["dp"])
        # an expert's gradient gathers every rank's tokens through the all-to-all: summed
        # over dp it holds all four ranks' contributions, so it is averaged over all four
        experts.set_gradient_divide_factor(float(world))
        experts.set_force_sum_reduction_for_comms(True)  # FSDP2's PREMUL_SUM has no gloo kernel
        api.fully_shard(model, mesh=everyone)
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
    return {"losses": torch.stack(losses), "params": params, "held": held}


def _case() -> dict[str, Any]:
    ref = _run(None)
    out: dict[str, Any] = {}
    for impl in ("torch", "fsdp"):
        got = _run(impl)
        out[impl] = {
            "loss": (got["losses"] - ref["losses"]).abs().max().item(),
            "param": max((got["params"][n] - ref["params"][n]).abs().max().item()
                         for n in ref["params"]),
            "held": got["held"],
        }
    return out


def test_experts_over_ep_and_fsdp_train_like_one_process(ranks) -> None:
    ranks_out = ranks.run(4, _case, timeout=300)
    for out in ranks_out:
        ours, theirs = out["fsdp"], out["torch"]
        assert theirs["param"] < 1e-4, out  # the layout and the divide factor are right
        assert ours["loss"] <= max(2 * theirs["loss"], 1e-5), out
        assert ours["param"] <= max(2 * theirs["param"], 1e-5), out
    # each EP rank's 2 experts per stack are cut over the 2 dp ranks, whole experts only
    for dp_pair in ((0, 2), (1, 3)):
        for stack in range(len(STACKS)):
            runs = [ranks_out[r]["fsdp"]["held"][stack] for r in dp_pair]
            assert sum(runs) == 2 * DIM * HIDDEN, ranks_out
            assert all(run % (DIM * HIDDEN) == 0 for run in runs), ranks_out
