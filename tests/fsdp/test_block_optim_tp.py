"""Muon and Shampoo on fsdp's tensor-parallel parameters (dp 2 x tp 2, 4 gloo ranks).

A TP-sharded matrix spans the TP ranks and its RaggedShard run cuts it again over dp, so no
rank can own a whole matrix in place: block-optim gathers such parameters to every rank
around the step (one owner computes each matrix) and slices the result back, saying so once
per parameter. Checked on identical gradients: every step each rank gathers the sharded
gradients and steps a one-process copy of the optimizer with them; after three steps the
combined-mesh parameters are *bit-equal* to that copy's (Muon with fp32 Newton-Schulz,
Shampoo in fp32). Training then matches one process on the global batch as closely as the
same optimizer under fsdp without TP (orthogonalization and inverse roots turn last-bit
gradient differences into visible ones, so the figure of merit is the dp-only run's). With
every TP cut uneven (``UnevenMLP``) the parameters are bit-equal to that copy's too."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.fsdp.models import RunSpec, full, make_optimizer
from tests.fsdp.tp_models import MODELS, VOCAB, TPRunSpec, batches, build_model

STEPS = 3


def _train(optimizer: str, tp: bool, model_name: str = "decoder") -> dict[str, Any]:
    import fsdp
    from tests.harness import device_mesh

    spec = TPRunSpec(steps=STEPS, model=model_name)
    build, parallelize, shard, vocab = MODELS[model_name]
    model, shadow = build(), build()
    if tp:
        world = device_mesh(2, 2, names=("dp", "tp"))
        parallelize(model, world["tp"])
        dp_mesh = world["dp"]
    else:
        dp_mesh = device_mesh(4, names=("dp",))
    shard(model, fsdp.fully_shard, dp_mesh)
    per_rank = spec.global_batch // dp_mesh.size()
    rank = dp_mesh.get_local_rank()
    data = batches(spec)[:, rank * per_rank:(rank + 1) * per_rank]
    named = list(model.named_parameters())
    shadow_named = list(shadow.named_parameters())
    opt = make_optimizer(RunSpec(optimizer), named)
    shadow_opt = make_optimizer(RunSpec(optimizer), shadow_named)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            tokens = data[step]
            loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab),
                                   tokens[:, 1:].reshape(-1))
            loss.backward()
            for (_, p), (_, q) in zip(named, shadow_named):
                q.grad = full(p.grad)
            shadow_opt.step()
            opt.step()
            opt.zero_grad()
    params = {n: full(p) for n, p in named}
    return {
        "bit_equal": [n for n, q in shadow_named if not torch.equal(params[n], q.detach())],
        "params": params,
        "gathered_warnings": sum("span the tensor-parallel ranks" in str(w.message)
                                 for w in caught),
    }


def _case(optimizer: str) -> dict[str, Any]:
    ref_model = build_model()
    spec = TPRunSpec(steps=STEPS)
    ref_opt = make_optimizer(RunSpec(optimizer), list(ref_model.named_parameters()))
    for tokens in batches(spec):
        F.cross_entropy(ref_model(tokens[:, :-1]).reshape(-1, VOCAB),
                        tokens[:, 1:].reshape(-1)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref = {n: p.detach() for n, p in ref_model.named_parameters()}
    out = {}
    for tp in (True, False):
        got = _train(optimizer, tp)
        out["tp" if tp else "dp"] = {
            "bit_equal_misses": got["bit_equal"],
            "error": max((got["params"][n] - ref[n]).abs().max().item() for n in ref),
            "gathered_warnings": got["gathered_warnings"],
        }
    return out


@pytest.mark.parametrize("optimizer", ["muon", "shampoo"])
def test_whole_matrix_optimizers_on_tensor_parallel_parameters(ranks, optimizer: str) -> None:
    for out in ranks.run(4, _case, optimizer, timeout=300):
        tp, dp = out["tp"], out["dp"]
        print(f"{optimizer}: error vs one process, TP {tp['error']:.3g}, dp only {dp['error']:.3g}")
        assert tp["bit_equal_misses"] == [], out
        assert tp["gathered_warnings"] > 0 and dp["gathered_warnings"] == 0, out
        assert tp["error"] <= max(2 * dp["error"], 1e-5), out


@pytest.mark.parametrize("optimizer", ["muon", "shampoo"])
def test_whole_matrix_optimizers_on_uneven_tensor_parallel_parameters(ranks, optimizer: str) -> None:
    """Every TP cut uneven (:class:`tests.fsdp.tp_models.UnevenMLP`): the gathered matrices
    are the whole ones and the results are cut back into each rank's own TP-local run, so
    on identical gradients the parameters equal a one-process optimizer's bit for bit."""
    for out in ranks.run(4, _train, optimizer, True, "uneven", timeout=300):
        assert out["bit_equal"] == [], out["bit_equal"]
        assert out["gathered_warnings"] > 0
