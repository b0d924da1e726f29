"""fsdp composed with *uneven* tensor parallelism on 4 gloo ranks (dp 2 x tp 2).

:class:`tests.fsdp.tp_models.UnevenMLP` cuts unevenly on both TP ranks everywhere (vocab 25,
``Linear(6, 13)``/``Linear(13, 6)``, ``Linear(6, 3)``/``Linear(3, 6)``): TP cuts as torch cuts
(``torch.chunk``: 13 rows give 7 + 6), and each data-parallel group plans its own buffers over
its own TP-local shapes, so the sharded parameters' RaggedShards differ between TP coordinates
and the 1-row TP-local weight of ``narrow`` leaves one dp rank no units.

* Layout: every rank's run is a ragged range of its own TP-local tensor; ``full_tensor()``,
  ``redistribute`` to ``(Replicate, tp)``, to ``(Replicate, Replicate)`` and back give the
  one-process values exactly; a reshape to another shape raises on every rank.
* Training parity: 5 AdamW steps with ``clip_grad_norm_``, each dp rank its own data, against
  one process on the global batch and FSDP2 (same TP plan, same mesh) in the same test.
* Checkpoints: saved by ``fsdp.checkpoint`` at dp 2 x tp 2 (model and AdamW state), loaded
  at dp 4 by torch's DCP and at dp 2 x tp 2 by ``fsdp.checkpoint``, bit-exactly; full state dicts get and set (also broadcast from rank 0) exactly.
* A cut that leaves a TP rank no elements raises on every rank, naming the parameter.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp
from tests.fsdp.tp_models import TPRunSpec, max_error, max_param_error, train

SPEC = TPRunSpec(steps=5, model="uneven")
TIMEOUT_S = 240.0


def _sharded(dp: int, tp: int) -> torch.nn.Module:
    """:class:`UnevenMLP` under fsdp over ``dp`` ranks, after TP over ``tp`` ranks if > 1."""
    from tests.fsdp.tp_models import build_uneven, parallelize_uneven, shard_uneven
    from tests.harness import device_mesh

    model = build_uneven()
    if tp > 1:
        world = device_mesh(dp, tp, names=("dp", "tp"))
        parallelize_uneven(model, world["tp"])
        dp_mesh = world["dp"]
    else:
        dp_mesh = device_mesh(dp)
    shard_uneven(model, fsdp.fully_shard, dp_mesh)
    return model


def _layout_case() -> dict[str, dict[str, Any]]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ragged_dtensor import RaggedShard, local_shaped
    from tests.fsdp.tp_models import build_uneven

    ref = {k: v.detach().clone() for k, v in build_uneven().state_dict().items()}
    model = _sharded(2, 2)
    out: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "tp"), name
        mesh = p.device_mesh
        dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
        ragged, tp_placement = p.placements
        assert isinstance(ragged, RaggedShard), (name, p.placements)
        full = ref[name]
        tp_local = full.chunk(2, tp_placement.dim)[tp] if isinstance(tp_placement, Shard) else full
        start, end = ragged.flat_range(tuple(tp_local.shape), dp)
        to_tp = p.redistribute(mesh, (Replicate(), tp_placement))
        replicated = p.redistribute(mesh, (Replicate(), Replicate()))
        out[name] = {
            "ragged": repr(ragged),
            "tp_rows": tp_local.shape[0],
            "local_numel": p.to_local().numel(),
            "run_exact": torch.equal(p.to_local(), tp_local.reshape(-1)[start:end]),
            "shaped_exact": torch.equal(local_shaped(p).reshape(-1), p.to_local()),
            "full_exact": torch.equal(p.full_tensor(), full),
            "tp_local_exact": torch.equal(to_tp.to_local(), tp_local),
            "replicated_exact": torch.equal(replicated.to_local(), full),
            "back_exact": torch.equal(replicated.redistribute(mesh, p.placements).to_local(),
                                      p.to_local())
                          and torch.equal(to_tp.redistribute(mesh, p.placements).to_local(),
                                          p.to_local()),
            "norm_error": (torch.linalg.vector_norm(p).full_tensor() - full.norm()).abs().item(),
            "same_shape_view_exact": torch.equal(p.view(p.shape).to_local(), p.to_local()),
        }
        if p.dim() > 1:  # a new shape would move the TP cut: refused, not a wrong alias
            with pytest.raises(NotImplementedError, match="reshapes"):
                p.view(-1)
    return out


def test_uneven_tp_layout_full_tensor_and_redistribute(ranks) -> None:
    results = ranks.run(4, _layout_case, timeout=TIMEOUT_S)
    for rank, out in enumerate(results):
        for name, facts in out.items():
            exact = [k for k in facts if k.endswith("_exact")]
            assert all(facts[k] for k in exact), (rank, name, facts)
            assert facts["norm_error"] <= 1e-5, (rank, name, facts)
    # ranks 0, 1 are (dp 0, tp 0), (dp 0, tp 1): uneven TP-local shapes, their own RaggedShards
    assert [results[r]["up.weight"]["tp_rows"] for r in range(2)] == [7, 6]
    assert results[0]["up.weight"]["ragged"] != results[1]["up.weight"]["ragged"]
    # narrow's TP-local weight is 2 rows at tp 0 and 1 row at tp 1; a dp rank holds none
    assert [results[r]["narrow.weight"]["tp_rows"] for r in range(2)] == [2, 1]
    assert [results[r]["narrow.weight"]["local_numel"] for r in (1, 3)] in ([6, 0], [0, 6])


def _empty_tp_rank_case() -> str:
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests.harness import device_mesh

    world = device_mesh(2, 2, names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(6, 1, bias=False))  # rows 1 + 0 over tp 2
    parallelize_module(model, world["tp"], {"0": ColwiseParallel()})
    with pytest.raises(NotImplementedError, match="no elements") as caught:
        fsdp.fully_shard(model, mesh=world["dp"])
    return str(caught.value)


def test_tp_cut_leaving_a_rank_nothing_raises_on_every_rank(ranks) -> None:
    messages = ranks.run(4, _empty_tp_rank_case, timeout=TIMEOUT_S)
    assert all("'0.weight'" in m for m in messages), messages


@functools.cache
def _reference() -> dict:
    return train(SPEC, None)


def test_uneven_tp_training_parity_with_one_process_and_fsdp2(ranks) -> None:
    """Losses, clip norms and full parameters after 5 AdamW steps with clipping: ours no
    further from the one-process run than FSDP2's, and within 1e-5 where FSDP2 is."""
    ref = _reference()
    out = {}
    for impl in ("fsdp", "torch"):
        results = ranks.run(4, train, SPEC, impl, timeout=TIMEOUT_S)
        assert all(r["losses"] == results[0]["losses"] for r in results[1:])
        out[impl] = results[0]
    assert any(n > SPEC.clip for n in ref["norms"])  # the clip acts
    for key, measure in (("losses", max_error), ("norms", max_error), ("params", max_param_error)):
        got, oracle = measure(out["fsdp"][key], ref[key]), measure(out["torch"][key], ref[key])
        print(f"uneven TP {key}: fsdp {got:.3g}, FSDP2 {oracle:.3g}")
        assert got <= max(oracle, 1e-5), (key, got, oracle)
    assert "RaggedShard" in out["fsdp"]["placements"]["up.weight"]
    assert "_StridedShard" in out["torch"]["placements"]["up.weight"]


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full parameters and AdamW moments, by parameter name."""
    from tests.fsdp.models import full

    out = {n: full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{key}"] = full(optimizer.state[p][key])
    return out


def _save(path: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F

    from tests.fsdp.tp_models import SEQ, UNEVEN_VOCAB

    model = _sharded(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank() // 2)  # per data-parallel rank (tp 2)
    for _ in range(2):
        tokens = torch.randint(0, UNEVEN_VOCAB, (2, SEQ + 1), generator=g)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, UNEVEN_VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    fsdp.checkpoint.save(path, model, optimizer, step=2)
    return _full_state(model, optimizer)


def _load(path: str, dp: int, tp: int, with_fsdp: bool) -> dict[str, Any]:
    """Load with ``fsdp.checkpoint.load``, or with torch's DCP and state dict functions
    from the DCP directory it wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _sharded(dp, tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if with_fsdp:
        assert fsdp.checkpoint.load(path, model, optimizer)[0] == 2
        return _full_state(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=fsdp.checkpoint.latest(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return _full_state(model, optimizer)


def _assert_same(got: dict[str, Any], saved: dict[str, Any], what: str) -> None:
    assert got.keys() == saved.keys(), what
    for name in saved:
        assert torch.equal(got[name], saved[name]), (what, name)


def test_dcp_of_uneven_tp_reshards_bit_exactly(ranks, tmp_path: Path) -> None:
    """Saved by ``fsdp.checkpoint.save`` at dp 2 x tp 2 (parameters and AdamW moments);
    loaded at dp 4 by torch's DCP and at dp 2 x tp 2 by ``fsdp.checkpoint.load``."""
    path = str(tmp_path / "ckpt")
    saved = ranks.run(4, _save, path, timeout=TIMEOUT_S)[0]
    for dp, tp, with_fsdp in ((4, 1, False), (2, 2, True)):
        for rank_out in ranks.run(4, _load, path, dp, tp, with_fsdp, timeout=TIMEOUT_S):
            _assert_same(rank_out, saved, f"dp {dp} x tp {tp}")


def _full_state_dict_case(weights: dict[str, torch.Tensor], broadcast: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from tests.fsdp.models import full

    model = _sharded(2, 2)
    given = {k: v.clone() for k, v in weights.items()} if dist.get_rank() == 0 or not broadcast else {}
    set_model_state_dict(model, given, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast))
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "got": got}


@pytest.mark.parametrize("broadcast", [False, True])
def test_full_state_dict_of_uneven_tp(ranks, broadcast: bool) -> None:
    """Every rank passing the full state dict, or rank 0 alone (each rank receives its run of
    its own TP-local tensor), loads exactly; the full state dict read back equals it."""
    from tests.fsdp.tp_models import build_uneven

    torch.manual_seed(9)
    weights = {k: torch.randn_like(v) for k, v in build_uneven().state_dict().items()}
    for out in ranks.run(4, _full_state_dict_case, weights, broadcast, timeout=TIMEOUT_S):
        _assert_same(out["params"], weights, f"set, broadcast={broadcast}")
        _assert_same(out["got"], weights, f"get, broadcast={broadcast}")
