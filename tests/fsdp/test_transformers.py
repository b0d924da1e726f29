"""Hugging Face ``transformers`` models, built from config only, trained with fsdp.

``LlamaForCausalLM`` and ``Qwen3MoeForCausalLM`` (experts fused into 3-D ``[experts, rows,
cols]`` tensors) from tiny configs, no download: each decoder layer and then the root wrapped
with ``fully_shard``, 3 steps on 2 gloo ranks, each rank on its half of the batch, compared
with one process on the whole batch, with AdamW and with Muon (fp32 Newton-Schulz, 3-D stacks
orthogonalized per expert). The tolerances are test_parity.py's and
test_block_optim_parity.py's: FSDP2 (``impl="torch"``) runs the same case as the oracle and
ours may be no further from one process than it is (AdamW: 1x its parameter error; Muon: 2x,
since orthogonalization magnifies last-bit gradient differences), plus a float-noise floor.

Every rank must also hold whole experts: the unit of a 3-D tensor is one expert
(``prod(shape[1:])``, fsdp's row for a 3-D tensor and Muon's ``unit_policy()``), so Muon and
8-bit blocks never straddle ranks.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.docs_pages import exec_source, python_blocks
from tests.fsdp.models import full, import_fsdp, max_loss_error, max_param_error
from tests.fsdp.test_block_optim_parity import LOSS_ABS, PARAM_ABS
from tests.fsdp.test_block_optim_parity import SLACK as MUON_SLACK
from tests.fsdp.test_parity import ADAMW_ABS, ADAMW_SLACK

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "qwen3_moe")
OPTIMIZERS = ("adamw", "muon")
STEPS, GLOBAL_BATCH, SEQ, WORLD_SIZE = 3, 8, 16, 2
TIMEOUT_S = 240.0
PAGE = "real-models.md"


def build_model(arch: str) -> torch.nn.Module:
    """A tiny model from config (same weights everywhere: seeded), eager attention."""
    common: dict[str, Any] = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=SEQ, tie_word_embeddings=False,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=96, **common))
    config = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, decoder_sparse_step=1, **common)
    return transformers.Qwen3MoeForCausalLM(config)


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if name == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=3e-3, weight_decay=0.01)
    from block_optim import Muon

    return Muon(named, lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)


def unit_policy(name: str) -> Any:
    """Muon's policy (one expert of a 3-D stack, one row of a matrix); fsdp's default rows
    already make one expert the unit of a 3-D tensor."""
    from block_optim import Muon

    return Muon.unit_policy() if name == "muon" else None


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(256, (STEPS, GLOBAL_BATCH, SEQ), generator=g)


def train(arch: str, optimizer_name: str, impl: str | None) -> dict[str, Any]:
    """3 steps; sharded by ``impl`` (on every rank) or in one process when ``impl`` is None."""
    model = build_model(arch)
    rank, world = (dist.get_rank(), dist.get_world_size()) if impl else (0, 1)
    whole_experts = True
    if impl:
        from tests.harness import device_mesh

        api, mesh = import_fsdp(impl), device_mesh(world)
        kwargs: dict[str, Any] = {"mesh": mesh}
        if impl == "fsdp":
            kwargs["unit_policy"] = unit_policy(optimizer_name)
        for layer in model.model.layers:
            api.fully_shard(layer, **kwargs)
        api.fully_shard(model, **kwargs)
        if impl == "fsdp":
            whole_experts = all(p.to_local().numel() % math.prod(p.shape[1:]) == 0
                                for p in model.parameters() if p.dim() == 3)
    optimizer = make_optimizer(optimizer_name, model)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for tokens in batches():
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step_loss = loss.detach().float()
        if impl:
            dist.all_reduce(step_loss)
            step_loss /= world
        losses.append(float(step_loss))
    return {"losses": losses, "params": {n: full(p).float() for n, p in model.named_parameters()},
            "whole_experts": whole_experts}


@functools.cache
def reference(arch: str, optimizer: str) -> dict[str, Any]:
    return train(arch, optimizer, None)


_sharded: dict[tuple[str, str, str], dict[str, Any]] = {}


def sharded(ranks, arch: str, optimizer: str, impl: str) -> dict[str, Any]:
    key = (arch, optimizer, impl)
    if key not in _sharded:
        results = ranks.run(WORLD_SIZE, train, arch, optimizer, impl, timeout=TIMEOUT_S)
        assert results[0]["losses"] == results[1]["losses"]
        assert all(r["whole_experts"] for r in results)
        _sharded[key] = results[0]
    return _sharded[key]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_model_matches_one_process(ranks, arch: str, optimizer: str) -> None:
    got, ref = sharded(ranks, arch, optimizer, "fsdp"), reference(arch, optimizer)
    oracle = sharded(ranks, arch, optimizer, "torch")
    assert ref["losses"][-1] < ref["losses"][0]  # it trains
    if optimizer == "adamw":
        assert max_loss_error(got["losses"], ref["losses"]) <= 1e-5
        ours, theirs = max_param_error(got["params"], ref["params"]), \
            max_param_error(oracle["params"], ref["params"])
        assert ours <= ADAMW_SLACK * theirs + ADAMW_ABS, (ours, theirs)
        assert theirs <= 1e-3
        return
    for measure, key, floor in ((max_loss_error, "losses", LOSS_ABS),
                                (max_param_error, "params", PARAM_ABS)):
        ours, theirs = measure(got[key], ref[key]), measure(oracle[key], ref[key])
        assert ours <= MUON_SLACK * theirs + floor, (key, ours, theirs)
        assert theirs <= 1e-2, (key, theirs)


def test_real_models_page_runs_on_two_ranks(ranks) -> None:
    blocks = python_blocks(PAGE)
    assert blocks
    assert ranks.run(2, exec_source, "\n".join(blocks), PAGE, timeout=TIMEOUT_S) == [True, True]
