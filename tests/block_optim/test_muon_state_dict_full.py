"""Muon's full optimizer state dict: param groups hold only plain values (ns_dtype by name),
so torch's state-dict tooling flattens them; the dtype still reaches Newton-Schulz."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from block_optim import Muon
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from tests.harness import device_mesh


def _full_state_dict() -> dict[str, object]:
    from ragged_dtensor import RaggedShard, distribute_tensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4, bias=False))
    mesh = device_mesh(dist.get_world_size())
    placement = [RaggedShard((0,), (1, 0))]
    weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, placement))
    model[0].weight = weight
    optimizer = Muon(list(model.named_parameters()), lr=0.02, ns_dtype=torch.float32)
    weight.grad = distribute_tensor(torch.randn(4, 6), mesh, placement)
    optimizer.step()
    full = get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True))
    return {"ns_dtype": full["param_groups"][0]["ns_dtype"], "keys": sorted(full["state"])}


def test_full_optimizer_state_dict_of_muon(ranks) -> None:
    for out in ranks.run(2, _full_state_dict):
        assert out == {"ns_dtype": "float32", "keys": ["0.weight"]}


@pytest.mark.parametrize("dtype", [torch.float32, "float32"])
def test_ns_dtype_accepted_as_dtype_or_name(dtype) -> None:
    p = nn.Parameter(torch.randn(4, 4))
    optimizer = Muon([("w", p)], lr=0.02, ns_dtype=dtype)
    assert optimizer.param_groups[0]["ns_dtype"] == "float32"
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([("w", p)], lr=0.02, ns_dtype=torch.int32)
