"""Full (unsharded) model and optimizer state dicts of fsdp models, through
``torch.distributed.checkpoint.state_dict``, for torch's and block-optim's optimizers.

For each optimizer (SGD with momentum, AdamW, Muon, Shampoo, AdamW8bit), the tiny decoder is
wrapped like :mod:`tests.fsdp.test_checkpoint` (each block, then the root, under the
optimizer's unit policy) and trained ``CUT`` steps at world size ``SAVE_WORLD``. Then:

* ``get_state_dict(full_state_dict=True, cpu_offload=True)`` gives rank 0 plain CPU tensors
  (no DTensor anywhere, nested states included) and every other rank two empty dicts; the
  model's tensors equal the gathered parameters bit for bit, and the optimizer's equal what
  the optimizer holds, read from ``optimizer.state`` and gathered (SGD's momentum, AdamW's
  moments and step, Muon's momentum, AdamW8bit's uint8 codes and scales, and every Shampoo
  preconditioner block, statistics and roots, merged from the ranks that own them). The same
  state also goes to disk through ``fsdp.checkpoint.save`` (DCP, sharded).
* Rank 0's dicts go through ``torch.save`` to a file. At world size ``LOAD_WORLD`` a model
  built on the meta device, wrapped and ``to_empty``'d, with a fresh optimizer, is filled by
  ``set_state_dict(full_state_dict=True, broadcast_from_rank0=True, strict=True)`` where only
  rank 0 passes the dicts. A second model resumes the DCP checkpoint with
  ``fsdp.checkpoint.load``.
* The full model and optimizer state gathered again from the broadcast-loaded model are
  bit-equal to the saved ones, and so is the DCP-loaded model's optimizer state; both models
  then train the remaining steps with bit-equal losses (same world size, same plan, same
  state: nothing may differ, so the test asks for equality, not a bound).

``strict=True`` with a key missing from, or unknown to, rank 0's dicts raises the same clear
error on every rank (never on rank 0 alone while the others wait in a collective).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.utils._pytree import tree_flatten, tree_map_only

from tests.fsdp import models
from tests.fsdp.models import RunSpec

SAVE_WORLD, LOAD_WORLD, CUT, STEPS = 3, 2, 2, 4
TIMEOUT_S = 120.0
OPTIMIZERS = ["sgd", "adamw", "muon", "shampoo", "adamw8bit"]
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)


def _build(spec: RunSpec, meta: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The wrapped decoder (each block, then the root, under the optimizer's unit policy) and
    its optimizer; ``meta``: built on the meta device, then ``to_empty`` (the pretrained flow)."""
    import fsdp
    from tests.harness import device_mesh

    if meta:
        with torch.device("meta"):
            model = models.build_model()
    else:
        model = models.build_model()
    kwargs: dict[str, Any] = {"mesh": device_mesh(dist.get_world_size())}
    if models.unit_policy(spec.optimizer) is not None:
        kwargs["unit_policy"] = models.unit_policy(spec.optimizer)
    for layer in model.layers:
        fsdp.fully_shard(layer, **kwargs)
    fsdp.fully_shard(model, **kwargs)
    if meta:
        model.to_empty(device="cpu")
    optimizer = models.make_optimizer(
        spec, [(n, p) for n, p in model.named_parameters() if p.requires_grad])
    return model, optimizer


def _leaves(tree: Any) -> list[Any]:
    return tree_flatten(tree)[0]


def _held_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the optimizer holds, read from ``optimizer.state`` (not through ``state_dict()``):
    every state gathered whole; Shampoo's preconditioner blocks, plain tensors on the rank
    that owns each, merged over ranks. A collective."""
    out = {}
    for name, param in model.named_parameters():
        if param not in optimizer.state:
            continue
        state = tree_map_only(torch.Tensor, lambda t: models.full(t).clone(),
                              dict(optimizer.state[param]))
        if "preconditioners" in state:
            owned: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(owned, state["preconditioners"])
            state["preconditioners"] = {k: v for blocks in owned for k, v in blocks.items()}
        out[name] = state
    return out


def save_full(spec: RunSpec, path: str, root: str) -> dict[str, Any] | None:
    """Train ``CUT`` steps, take the full state dicts (rank 0), ``torch.save`` them to
    ``path`` and save the same state with ``fsdp.checkpoint`` under ``root``."""
    from fsdp import checkpoint

    model, optimizer = _build(spec)
    models.sharded_steps(model, optimizer, spec, 0, CUT)
    params = {n: models.full(p) for n, p in model.named_parameters(remove_duplicate=False)}
    held = _held_state(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FULL)
    checkpoint.save(root, model, optimizer, step=CUT)
    if dist.get_rank() != 0:
        assert model_sd == {} and optim_sd == {}, (model_sd.keys(), optim_sd.keys())
        return None
    tensors = [t for t in _leaves((model_sd, optim_sd)) if isinstance(t, torch.Tensor)]
    bad = [type(t).__name__ + "@" + str(t.device) for t in tensors
           if type(t) is not torch.Tensor or t.device.type != "cpu"]
    assert not bad, bad
    torch.save({"model": model_sd, "optim": optim_sd}, path)
    return {"model": model_sd, "optim": optim_sd, "params": params, "held": held}


def _full(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The full optimizer (or, without one, model) state dict on rank 0, cloned: with
    ``cpu_offload`` a CPU tensor that needs no gathering (AdamW's ``step``, a buffer) is the
    module's or optimizer's own, which training changes."""
    if optimizer is None:
        state = get_model_state_dict(model, options=FULL)
    else:
        state = get_optimizer_state_dict(model, optimizer, options=FULL)
    return tree_map_only(torch.Tensor, torch.clone, state)


def resume_both(spec: RunSpec, path: str, root: str) -> dict[str, Any] | None:
    """Load rank 0's full state dicts by broadcast into a meta-built model, and the DCP
    checkpoint into another; gather both optimizers' full state; train both on."""
    from fsdp import checkpoint

    saved = torch.load(path) if dist.get_rank() == 0 else {"model": {}, "optim": {}}
    model, optimizer = _build(spec, meta=True)
    set_state_dict(model, optimizer, model_state_dict=saved["model"],
                   optim_state_dict=saved["optim"], options=BROADCAST)
    dcp_model, dcp_optimizer = _build(spec)
    assert checkpoint.load(root, dcp_model, dcp_optimizer) == (CUT, None)
    out = {"broadcast_model": _full(model), "broadcast_optim": _full(model, optimizer),
           "dcp_optim": _full(dcp_model, dcp_optimizer)}
    out["broadcast_losses"] = models.sharded_steps(model, optimizer, spec, CUT, STEPS)
    out["dcp_losses"] = models.sharded_steps(dcp_model, dcp_optimizer, spec, CUT, STEPS)
    return out if dist.get_rank() == 0 else None


def _assert_equal(got: Any, want: Any, what: str) -> None:
    """Bit-equal through nested states: tensors of the same type, dtype and values, and
    every other value (param-group entries, names) equal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), (
            what, sorted(got, key=str) if isinstance(got, dict) else got, sorted(want, key=str))
        for key in want:
            _assert_equal(got[key], want[key], f"{what}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        # torch's full-state-dict load rebuilds param groups through its flattening, which
        # turns tuples (betas) into lists, for torch's optimizers as for block-optim's
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (what, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal(g, w, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert type(got) is type(want) and got.dtype == want.dtype, (what, got, want)
        assert torch.equal(got, want), (what, (got - want).abs().max() if got.is_floating_point()
                                        else (got != want).sum())
    else:
        assert got == want, (what, got, want)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_full_state_dict_moves_to_another_world_size(ranks, tmp_path: Path,
                                                     optimizer: str) -> None:
    spec = RunSpec(optimizer, steps=STEPS)
    path, root = str(tmp_path / "full.pt"), str(tmp_path / "dcp")
    saved = ranks.run(SAVE_WORLD, save_full, spec, path, root, timeout=TIMEOUT_S)[0]
    buffers = {f"layers.{i}.attn.causal" for i in range(models.LAYERS)}
    assert set(saved["model"]) == set(saved["params"]) | buffers
    _assert_equal({k: saved["model"][k] for k in saved["params"]}, saved["params"], "model")
    _assert_equal(saved["optim"]["state"], saved["held"], f"{optimizer} full state")
    resumed = ranks.run(LOAD_WORLD, resume_both, spec, path, root, timeout=TIMEOUT_S)[0]
    _assert_equal(resumed["broadcast_model"], saved["model"], f"{optimizer} model")
    _assert_equal(resumed["broadcast_optim"], saved["optim"], f"{optimizer} broadcast")
    _assert_equal(resumed["dcp_optim"], saved["optim"], f"{optimizer} dcp")
    assert resumed["broadcast_losses"] == resumed["dcp_losses"]


def _bad(model_sd: dict[str, Any], optim_sd: dict[str, Any], case: str
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A copy of the full state dicts with one key missing or unknown."""
    model_sd, optim_sd = dict(model_sd), {**optim_sd, "state": dict(optim_sd["state"])}
    if case == "model key missing":
        del model_sd["norm.weight"]
    elif case == "model key unknown":
        model_sd["norm.scale"] = model_sd["norm.weight"].clone()
    elif case == "optimizer state missing":
        del optim_sd["state"]["norm.weight"]
    return model_sd, optim_sd


STRICT_CASES = {
    "model key missing": "missing key(s) 'norm.weight'",
    "model key unknown": "unexpected key(s) 'norm.scale'",
    "optimizer state missing": "Missing optimizer state for parameter 'norm.weight'",
}


def strict_errors(broadcast: bool) -> dict[str, str]:
    """For each case, the error ``set_state_dict(strict=True)`` raises on this rank (every
    rank must raise); then the intact dicts still load, so the ranks are still in step."""
    spec = RunSpec("adamw", steps=1)
    model, optimizer = _build(spec)
    models.sharded_steps(model, optimizer, spec, 0, 1)
    full = StateDictOptions(full_state_dict=True, cpu_offload=broadcast)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=full)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=True)
    holds = not broadcast or dist.get_rank() == 0
    out = {}
    for case in STRICT_CASES:
        target, target_optimizer = _build(spec)
        bad_model, bad_optim = _bad(model_sd, optim_sd, case) if holds else ({}, {})
        try:
            set_state_dict(target, target_optimizer, model_state_dict=bad_model,
                           optim_state_dict=bad_optim, options=options)
            out[case] = "no error"
        except RuntimeError as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
    target, target_optimizer = _build(spec)
    set_state_dict(target, target_optimizer, model_state_dict=model_sd if holds else {},
                   optim_state_dict=optim_sd if holds else {}, options=options)
    for mine, theirs in zip(target.parameters(), model.parameters()):
        assert torch.equal(mine.full_tensor(), theirs.full_tensor())
    return out


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast_from_rank0", "every_rank"])
def test_strict_rejects_a_missing_or_unknown_key_on_every_rank(ranks, broadcast: bool) -> None:
    results = ranks.run(LOAD_WORLD, strict_errors, broadcast, timeout=TIMEOUT_S)
    for rank, errors in enumerate(results):
        for case, expect in STRICT_CASES.items():
            assert expect in errors[case] and "strict=True" in errors[case], (
                rank, case, errors[case])
