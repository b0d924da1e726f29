"""Model weights in and out of fsdp: FSDP2 interop, full state dicts, pretrained weights,
``keep_last`` and the errors of ``fsdp.checkpoint.load``.

* FSDP2 <-> fsdp: weights saved by one (``fsdp.checkpoint.save``, DCP underneath) at one
  world size load into the other at another, bit-equal.
* A full state dict gathered from fsdp (``full_state_dict`` + ``cpu_offload``: plain tensors
  on rank 0 only) loads into the plain model with ``load_state_dict(strict=True)``.
* Pretrained weights: only rank 0 holds them; the model is built on the meta device, wrapped,
  ``to_empty``'d and filled by ``broadcast_from_rank0``. Every rank ends with the source
  weights; the peak RSS growth of the other ranks during the load (Linux ``VmHWM`` after a
  reset through ``/proc/self/clear_refs``) stays below the full model's size (measured: 0 B
  to 2.3 MB, noisy, against 8.4 MB; rank 0: 8.1 MB).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from tests.fsdp import models
from tests.fsdp.test_checkpoint import _shard

TIMEOUT_S = 180.0


def _trained(impl: str) -> nn.Module:
    """The tiny decoder wrapped by ``impl`` after one SGD step (weights unlike the init's)."""
    model = models.build_model()
    _shard(model, impl, None)
    spec = models.RunSpec("sgd", steps=1)
    optimizer = models.make_optimizer(spec, [(n, p) for n, p in model.named_parameters()
                                             if p.requires_grad])
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = models.batches(spec)[0]
    per_rank = spec.global_batch // world
    models._loss(model, tokens[rank * per_rank:(rank + 1) * per_rank]).backward()
    optimizer.step()
    return model


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: models.full(p) for n, p in model.named_parameters()}


def save_weights(impl: str, root: str) -> dict[str, torch.Tensor]:
    from fsdp import checkpoint

    model = _trained(impl)
    checkpoint.save(root, model, None, step=1)
    return _full_params(model)


def load_weights(impl: str, root: str) -> dict[str, torch.Tensor]:
    from fsdp import checkpoint

    model = models.build_model()
    _shard(model, impl, None)
    assert checkpoint.load(root, model) == (1, None)
    return _full_params(model)


@pytest.mark.parametrize(("source", "target"), [("torch", "fsdp"), ("fsdp", "torch")])
def test_weights_move_between_fsdp2_and_fsdp(ranks, tmp_path: Path, source: str,
                                             target: str) -> None:
    saved = ranks.run(2, save_weights, source, str(tmp_path), timeout=TIMEOUT_S)[0]
    loaded = ranks.run(3, load_weights, target, str(tmp_path), timeout=TIMEOUT_S)[0]
    torch.testing.assert_close(loaded, saved, rtol=0, atol=0)
    assert not torch.equal(saved["embed.weight"], models.build_model().embed.weight)


def full_state_dict_on_rank0() -> dict[str, Any]:
    model = _trained("fsdp")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"state": get_model_state_dict(model, options=options),
            "params": _full_params(model)}


def test_full_state_dict_loads_into_plain_module_strictly(ranks) -> None:
    results = ranks.run(3, full_state_dict_on_rank0, timeout=TIMEOUT_S)
    assert all(r["state"] == {} for r in results[1:])
    state = results[0]["state"]
    assert all(type(t) is torch.Tensor for t in state.values())
    plain = models.build_model()
    plain.load_state_dict(state, strict=True)
    torch.testing.assert_close(dict(plain.named_parameters()), results[0]["params"],
                               rtol=0, atol=0)


class Wide(nn.Sequential):
    """Eight 512 x 512 layers (8 MiB of fp32): big enough for RSS to measure."""

    def __init__(self) -> None:
        super().__init__(*(nn.Linear(512, 512) for _ in range(8)))


def _peak_rss_growth(fn: Any) -> int:
    """Bytes the process's peak RSS rose above its RSS while ``fn`` ran (Linux)."""

    def read(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    Path("/proc/self/clear_refs").write_text("5")
    before = read("VmRSS:")
    fn()
    return read("VmHWM:") - before


def pretrained(weights: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``weights`` is the full state dict on rank 0 and ``None`` elsewhere."""
    import fsdp
    from tests.harness import device_mesh

    with torch.device("meta"):
        model = Wide()
    for layer in model:
        fsdp.fully_shard(layer, mesh=device_mesh(dist.get_world_size()))
    fsdp.fully_shard(model, mesh=device_mesh(dist.get_world_size()))
    model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    growth = _peak_rss_growth(lambda: set_model_state_dict(model, weights or {}, options=options))
    return {"params": _full_params(model), "growth": growth}


def test_pretrained_weights_broadcast_from_rank0_into_meta_model(ranks) -> None:
    torch.manual_seed(5)
    source = Wide().state_dict()
    full_bytes = sum(t.numel() * t.element_size() for t in source.values())
    world = 3
    results = ranks.run(world, _pretrained_on_rank0, source, timeout=TIMEOUT_S)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["params"], source, rtol=0, atol=0,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")
    for rank, result in enumerate(results[1:], start=1):
        assert result["growth"] < full_bytes, (rank, result["growth"], full_bytes)


def _pretrained_on_rank0(source: dict[str, torch.Tensor]) -> dict[str, Any]:
    return pretrained(source if dist.get_rank() == 0 else None)


def keep_last_run(root: str) -> list[str]:
    from fsdp import checkpoint

    model = models.build_model()
    _shard(model, "fsdp", None)
    for step in (1, 2, 3, 4):
        checkpoint.save(root, model, None, step=step, keep_last=2, extra={"s": step})
    return sorted(p.name for p in Path(root).iterdir())


def test_keep_last_keeps_the_newest_and_load_picks_the_latest(ranks, tmp_path: Path) -> None:
    from fsdp import checkpoint

    names = ranks.run(2, keep_last_run, str(tmp_path), timeout=TIMEOUT_S)[0]
    assert names == ["step_000000003", "step_000000004"]
    info = checkpoint.read_info(checkpoint.latest(tmp_path))
    assert (info.step, info.world_size, info.extra) == (4, 2, {"s": 4})
    assert set(info.plan_fingerprints) == {"", "layers.0", "layers.1"}
    assert {"torch", "fsdp"} <= set(info.versions)
    # An unfinished save of a later step is ignored; so is a step directory without metadata.
    (tmp_path / ".tmp-step_000000009").mkdir()
    (tmp_path / "step_000000008").mkdir()
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000000004"


def load_error(root: str, wide: bool) -> str:
    """The error ``load`` raises on this rank (it must raise on every rank)."""
    from fsdp import checkpoint

    model = Wide() if wide else models.build_model()
    if not wide:
        _shard(model, "fsdp", None)
    try:
        checkpoint.load(root, model)
    except (OSError, KeyError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_load_errors_name_the_path_on_every_rank(ranks, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ranks.run(2, save_weights, "fsdp", str(root), timeout=TIMEOUT_S)
    good = root / "step_000000001"
    cases = {"empty": tmp_path / "empty", "truncated": tmp_path / "truncated",
             "other_model": good}
    cases["empty"].mkdir()
    shutil.copytree(good, cases["truncated"])
    data_file = sorted(cases["truncated"].glob("*.distcp"))[-1]
    os.truncate(data_file, data_file.stat().st_size // 2)
    expect = {"empty": "is neither an fsdp checkpoint",
              "truncated": f"is truncated: {data_file.name}",
              "other_model": "was saved from another model"}
    for name, path in cases.items():
        errors = ranks.run(2, load_error, str(path), name == "other_model", timeout=TIMEOUT_S)
        for rank, error in enumerate(errors):
            assert expect[name] in error and str(path) in error, (name, rank, error)
    assert json.loads((good / "fsdp_checkpoint.json").read_text())["step"] == 1


def async_save_while_training(root: str) -> dict[str, Any]:
    """Save asynchronously, train two more steps while it writes, then load it back."""
    from fsdp import checkpoint

    model = _trained("fsdp")
    at_save = _full_params(model)
    pending = checkpoint.save(root, model, None, step=1, async_save=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        models._loss(model, models.batches(models.RunSpec(steps=1))[0][:2]).backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = _full_params(model)
    assert pending.result() == checkpoint.step_dir(root, 1)
    checkpoint.load(root, model)
    return {"at_save": at_save, "moved": moved, "loaded": _full_params(model)}


def test_async_save_keeps_the_weights_of_the_moment_it_was_called(ranks,
                                                                   tmp_path: Path) -> None:
    out = ranks.run(3, async_save_while_training, str(tmp_path), timeout=TIMEOUT_S)[0]
    torch.testing.assert_close(out["loaded"], out["at_save"], rtol=0, atol=0)
    assert not torch.equal(out["moved"]["embed.weight"], out["at_save"]["embed.weight"])


def save_error(root: str, kwargs: dict[str, Any]) -> str:
    from fsdp import checkpoint

    model = models.build_model()
    _shard(model, "fsdp", None)
    try:
        checkpoint.save(root, model, None, **kwargs)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


SAVE_ERRORS = {
    "negative step": ({"step": -1}, "ValueError: save: step must be an int >= 0, got -1"),
    "step not an int": ({"step": "3"}, "ValueError: save: step must be an int >= 0, got '3'"),
    "keep_last 0": ({"step": 2, "keep_last": 0}, "keep_last must be an int >= 1 or None, got 0"),
    "extra not JSON": ({"step": 2, "extra": {"f": print}}, "extra must be JSON-serialisable"),
    "step exists": ({"step": 1}, "FileExistsError: save: checkpoint"),
}


@pytest.mark.parametrize("case", sorted(SAVE_ERRORS))
def test_save_rejects_bad_input_on_every_rank_and_keeps_what_was_saved(
        ranks, tmp_path: Path, case: str) -> None:
    from fsdp import checkpoint

    ranks.run(2, save_weights, "fsdp", str(tmp_path), timeout=TIMEOUT_S)
    kwargs, expect = SAVE_ERRORS[case]
    for rank, error in enumerate(ranks.run(2, save_error, str(tmp_path), kwargs)):
        assert expect in error, (case, rank, error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000001"]
    assert checkpoint.read_info(tmp_path / "step_000000001").step == 1
