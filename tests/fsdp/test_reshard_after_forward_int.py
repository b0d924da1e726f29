"""``reshard_after_forward=<int>``: after forward each rank keeps ``1/k`` of a group's unsharded
buffer and the backward all-gathers over ``k`` neighbouring ranks only, as FSDP2 does.

Measured side by side with FSDP2 (same model, same ``k``, 4 gloo ranks): the all-gathers each
backward issues (group size, count), the elements every rank holds between forward and
backward (``k=2`` against ``True`` and ``False``), and parameters after three AdamW steps
against one process. FSDP2's argument rules (a factor of the shard size; ``1`` means
``False``, the full size means ``True``) hold on every rank.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dbuffer.collective_log import record_collectives
from tests.fsdp.models import full, import_fsdp
from tests.harness import device_mesh

DIM, BLOCKS, STEPS = 24, 3, 3


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM + 1), nn.GELU(), nn.Linear(2 * DIM + 1, DIM))
            for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))


def _run(impl: str | None, after: bool | int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Blocks()
    held: list[int] = []
    gathers: list[tuple[int, int, int]] = []
    if impl is not None:
        api = import_fsdp(impl)
        mesh = device_mesh(world)
        for block in model.blocks:
            api.fully_shard(block, mesh=mesh, reshard_after_forward=after)
        api.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        if impl is None:
            loss = sum(model(_batch(step, r)).pow(2).mean() for r in range(world)) / world
        else:
            loss = model(_batch(step, rank)).pow(2).mean()
            if impl == "fsdp" and step == STEPS - 1:
                held = _held_after_forward(model)
        with record_collectives() as calls:
            loss.backward()
        if step == STEPS - 1:
            gathers = [(c.group_size, c.input_numel, c.output_numel) for c in calls
                       if c.name in ("all_gather_single", "all_gather_into_tensor")]
        optimizer.step()
        optimizer.zero_grad()
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "held": held,
            "gathers": gathers}


def _held_after_forward(model: Blocks) -> list[int]:
    """Per block group: unsharded elements still allocated plus elements kept as pieces."""
    from fsdp.state import get_state

    held = []
    for block in model.blocks:
        group = get_state(block).group
        held.append(sum((b.unsharded_buffer.numel() if b.is_unsharded else 0) + b.piece_numel
                        for b in group.buffers))
    return held


def _unsharded_numel() -> list[int]:
    """Per block group: the length of its unsharded buffers (padding included)."""
    from fsdp.state import get_state

    model = Blocks()
    mesh = device_mesh(dist.get_world_size())
    for block in model.blocks:
        import_fsdp("fsdp").fully_shard(block, mesh=mesh)
    return [sum(b.shard_size * b.world_size for b in get_state(block).group.buffers)
            for block in model.blocks]


def _case() -> dict[str, Any]:
    ref = _run(None, True)
    out: dict[str, Any] = {"numel": _unsharded_numel()}
    for impl in ("torch", "fsdp"):
        for after in (True, 2, False):
            got = _run(impl, after)
            error = max((got["params"][n] - ref["params"][n]).abs().max().item()
                        for n in ref["params"])
            out[(impl, after)] = {"error": error, "held": got["held"], "gathers": got["gathers"]}
    return out


def test_int_reshards_to_the_smaller_group_like_fsdp2(ranks) -> None:
    for out in ranks.run(4, _case, timeout=300):
        numel = out["numel"]
        torch_2, fsdp_2 = out[("torch", 2)], out[("fsdp", 2)]
        # parity: no further from one process than FSDP2 with the same k
        for after in (True, 2, False):
            assert out[("fsdp", after)]["error"] <= max(2 * out[("torch", after)]["error"], 1e-5)
        # memory between forward and backward: nothing, half the buffer, all of it
        assert out[("fsdp", True)]["held"] == [0] * BLOCKS
        assert fsdp_2["held"] == [n // 2 for n in numel]
        assert out[("fsdp", False)]["held"] == numel
        # backward: one all-gather per block over 2 ranks, from the kept half (FSDP2 too);
        # none with False (the root keeps its parameters in both systems)
        assert fsdp_2["gathers"] == [(2, n // 2, n) for n in reversed(numel)]
        assert [g[0] for g in torch_2["gathers"]] == [2] * BLOCKS
        assert [g[0] for g in out[("fsdp", True)]["gathers"]] == [4] * BLOCKS
        assert out[("fsdp", False)]["gathers"] == out[("torch", False)]["gathers"] == []


def _argument_case() -> dict[str, Any]:
    from fsdp.state import get_state

    api = import_fsdp("fsdp")
    mesh = device_mesh(dist.get_world_size())
    out: dict[str, Any] = {}
    with pytest.raises(ValueError) as info:
        api.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2)
    out["error"] = str(info.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one = api.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=1)
    out["warned"] = any("world size 1" in str(w.message) for w in caught)
    out["one"] = get_state(one).group.config.reshard_after_forward
    whole = api.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)
    out["whole"] = get_state(whole).group.config.reshard_after_forward
    return out


def test_int_argument_follows_fsdp2s_rules_on_every_rank(ranks) -> None:
    for out in ranks.run(3, _argument_case):
        assert out["error"] == ("If passing reshard_after_forward as an int, it should be a "
                                "factor of 3, not 2")
        assert out["warned"] and out["one"] is False and out["whole"] is True
