"""Code that tests ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` sees fsdp's modules.

Libraries switch on that check (Hugging Face accelerate's ``fsdp2_prepare_model`` and
Trainer, torch's pipelining). fsdp's ``FSDP<Cls>`` classes list torch's ``FSDPModule`` last
in their bases, so the check holds exactly where it holds under FSDP2 (same modules, the
original class at MRO index 2), while every method torch's class defines resolves to fsdp's
own. Tested with the callers against FSDP2 in the same test: accelerate's preparation leaves
an already-sharded model alone, the Trainer's reshard loop reshards, torch's
``distributed.checkpoint.state_dict`` helpers give and take the same values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor

from tests.fsdp.models import RunSpec, build_model, import_fsdp, shard
from tests.harness import device_mesh


def _fsdp_modules(impl: str) -> dict[str, Any]:
    model = build_model()
    shard(model, impl, RunSpec(), device_mesh(dist.get_world_size()))
    out: dict[str, Any] = {
        "fsdp_modules": [n for n, m in model.named_modules() if isinstance(m, TorchFSDPModule)],
        "orig_at_2": type(model).__mro__[2].__name__,
        "indexing": type(model.layers[0]).__name__,
    }
    if impl == "fsdp":
        import fsdp

        # every attribute torch's class defines resolves to fsdp's class, not torch's
        cls = type(model)
        out["owners"] = {
            name: next(k for k in cls.__mro__ if name in vars(k)).__module__
            for name, value in vars(TorchFSDPModule).items()
            if callable(value) or isinstance(value, (staticmethod, classmethod))}
        out["ours"] = fsdp.FSDPModule.__module__
        model._set_unshard_async_op(True)  # FSDP2's private setter: accepted, no effect
    return out


def test_isinstance_holds_where_fsdp2s_does(ranks) -> None:
    theirs = ranks.run(2, _fsdp_modules, "torch")[0]
    for ours in ranks.run(2, _fsdp_modules, "fsdp"):
        assert ours["fsdp_modules"] == theirs["fsdp_modules"]
        assert ours["fsdp_modules"][0] == "" and len(ours["fsdp_modules"]) > 1
        assert ours["orig_at_2"] == theirs["orig_at_2"] == "TinyDecoder"
        assert ours["indexing"] == theirs["indexing"]
        assert ours["owners"] and set(ours["owners"].values()) == {ours["ours"]}, ours["owners"]


def _callers(impl: str, full_sd: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    api = import_fsdp(impl)
    torch.manual_seed(0)
    model = build_model()
    mesh = device_mesh(dist.get_world_size())
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model, mesh=mesh, reshard_after_forward=False)
    out: dict[str, Any] = {}

    # accelerate: an FSDPModule is returned as is (never sharded a second time)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    params = [id(p) for p in model.parameters()]
    prepared = fsdp2_prepare_model(None, model)
    out["accelerate_same"] = prepared is model and [id(p) for p in model.parameters()] == params

    # transformers' Trainer, before creating the optimizer (trainer.py): a forward left the
    # root (reshard_after_forward=False) unsharded; every FSDPModule is resharded, so the
    # optimizer gets the sharded parameters. (Under no_grad fsdp reshards by itself: no
    # backward will use the unsharded parameters.)
    model(torch.zeros(1, 4, dtype=torch.long))
    out["unsharded_after_eval"] = not all(isinstance(p, DTensor) for p in model.parameters())
    for module in model.modules():
        if isinstance(module, TorchFSDPModule):
            module.reshard()
    out["sharded_after_loop"] = all(isinstance(p, DTensor) for p in model.parameters())

    # torch.distributed.checkpoint.state_dict: full state dicts in and out
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if full_sd is not None:
        set_model_state_dict(model, full_sd, options=options)
    out["full"] = get_model_state_dict(model, options=options)
    out["sharded_types"] = sorted({type(v).__name__ for v in get_model_state_dict(model).values()})
    return out


def test_callers_of_isinstance_behave_as_with_fsdp2(ranks) -> None:
    pytest.importorskip("accelerate")
    theirs = ranks.run(2, _callers, "torch", None)[0]
    torch.manual_seed(9)
    other = {k: torch.randn_like(v) if v.is_floating_point() else v
             for k, v in theirs["full"].items()}
    other["head.weight"] = other["embed.weight"]  # tied
    ours = ranks.run(2, _callers, "fsdp", None)[0]  # full state dicts: rank 0's (cpu_offload)
    for key in ("accelerate_same", "unsharded_after_eval", "sharded_after_loop", "sharded_types"):
        assert ours[key] == theirs[key], key
    assert ours["accelerate_same"] and ours["unsharded_after_eval"] and ours["sharded_after_loop"]
    assert theirs["full"] and ours["sharded_types"] == ["DTensor", "Tensor"]
    torch.testing.assert_close(ours["full"], theirs["full"], rtol=0, atol=0)
    loaded = ranks.run(2, _callers, "fsdp", other)[0]
    torch.testing.assert_close(loaded["full"], other, rtol=0, atol=0)
