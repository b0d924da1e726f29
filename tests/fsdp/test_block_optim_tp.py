"""Muon, Shampoo and AdamW8bit on fsdp's tensor-parallel parameters (dp 2 x tp 2, 4 gloo ranks).

A TP-sharded matrix spans the TP ranks and its RaggedShard run cuts it again over dp, so no
rank can own a whole matrix in place: block-optim gathers such parameters to every rank
around the step (one owner computes each matrix) and slices the result back, saying so once
per parameter. AdamW8bit is elementwise but for its 256-element quantization blocks: it steps
each TP-local tensor as a tensor of its own, so its one-process reference is AdamW8bit on
every TP-local tensor (:class:`TPLocalAdamW8bit`; a low ``min_8bit_numel`` quantizes this
small model's weights). Planned with ``AdamW8bit.unit_policy()`` each rank holds whole blocks
and steps with no communication; with fsdp's default row units the dp cuts split blocks and
the parameters are redistributed along dp around the step, with a warning.

Checked on identical gradients: every step each rank gathers the sharded gradients and steps a
one-process copy of the optimizer with them; after the steps the combined-mesh parameters are
*bit-equal* to that copy's (Muon with fp32 Newton-Schulz, Shampoo in fp32, AdamW8bit). Training
then matches one process on the global batch as closely as the same optimizer under fsdp
without TP (orthogonalization, inverse roots and requantization turn last-bit gradient
differences into visible ones, so the figure of merit is the dp-only run's). With every TP cut
uneven (``UnevenMLP``) Muon's and Shampoo's parameters are bit-equal to that copy's too."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from tests.fsdp.models import RunSpec, full, make_optimizer
from tests.fsdp.tp_models import MODELS, VOCAB, TPRunSpec, batches, build_model, parallelize
from tests.tp_reference import tp_local_pieces

MIN_8BIT = 256
"""AdamW8bit's fp32 threshold here: the model's TP-local weights (242 to 550 elements) straddle
it, so some keep fp32 moments and the rest are quantized in one to three blocks."""

SLACK = 2.0
"""How far past the baseline's error ours may be: a random draw of summation order (as in
test_block_optim_parity)."""

GATHERED = "span the tensor-parallel ranks"
REALIGNED = "split 256-element quantization blocks"


class TPLocalAdamW8bit:
    """AdamW8bit in one process on every TP-local tensor of each parameter, each a tensor of its
    own: what fsdp over TP steps, with none of its machinery (pieces cut with ``torch.chunk``,
    joined back with ``torch.cat``). With no TP placements it is AdamW8bit on whole tensors."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], tp_placements: dict[str, Placement],
                 tp: int, **kwargs: Any) -> None:
        from block_optim import AdamW8bit

        self.named, self.tp_placements, self.tp = named, tp_placements, tp
        self.pieces = {n: [nn.Parameter(c.detach().clone())
                           for c in tp_local_pieces(p, tp_placements.get(n), tp)] for n, p in named}
        self.optimizer = AdamW8bit([(f"{n}.tp{i}", q) for n, qs in self.pieces.items()
                                    for i, q in enumerate(qs)], **kwargs)

    @torch.no_grad()
    def step(self) -> None:
        for name, p in self.named:
            grads = tp_local_pieces(p.grad, self.tp_placements.get(name), self.tp)
            for q, g in zip(self.pieces[name], grads):
                q.grad = g.clone()
        self.optimizer.step()
        for name, p in self.named:
            placement = self.tp_placements.get(name)
            dim = placement.dim if isinstance(placement, Shard) else 0
            p.copy_(torch.cat([q.detach() for q in self.pieces[name]], dim=dim))

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None


@dataclass(frozen=True)
class Setup:
    """One optimizer under test.

    Attributes:
        optimizer: ``"muon"``, ``"shampoo"`` or ``"adamw8bit"``.
        planned: fsdp plans with the optimizer's ``unit_policy`` (else its default rows).
        steps: optimizer steps.
        model: a key of :data:`tests.fsdp.tp_models.MODELS`.
    """

    optimizer: str
    planned: bool = False
    steps: int = 3
    model: str = "decoder"

    def make(self, named: list[tuple[str, nn.Parameter]]) -> Any:
        if self.optimizer == "adamw8bit":
            from block_optim import AdamW8bit

            return AdamW8bit(named, lr=3e-3, min_8bit_numel=MIN_8BIT)
        return make_optimizer(RunSpec(self.optimizer), named)

    def reference(self, named: list[tuple[str, nn.Parameter]],
                  tp_placements: dict[str, Placement]) -> Any:
        """The one-process optimizer the sharded run must equal on identical gradients."""
        if self.optimizer == "adamw8bit":
            return TPLocalAdamW8bit(named, tp_placements, TPRunSpec().tp, lr=3e-3,
                                    min_8bit_numel=MIN_8BIT)
        return self.make(named)

    def unit_policy(self) -> Callable[[str, torch.Tensor], int] | None:
        if not self.planned:
            return None
        from block_optim import AdamW8bit

        assert self.optimizer == "adamw8bit", self
        return AdamW8bit.unit_policy(min_8bit_numel=MIN_8BIT)


def _tp_placements() -> dict[str, Placement]:
    """Each parameter's placement on the TP mesh under the parity model's plan."""
    from tests.harness import device_mesh

    model = build_model()
    parallelize(model, device_mesh(2, 2, names=("dp", "tp"))["tp"])
    return {n: p.placements[0] for n, p in model.named_parameters()}


def _train(setup: Setup, tp: bool) -> dict[str, Any]:
    import fsdp
    from tests.harness import device_mesh

    spec = TPRunSpec(steps=setup.steps, model=setup.model)
    build, tensor_parallel, shard, vocab = MODELS[setup.model]
    model, shadow = build(), build()
    if tp:
        world = device_mesh(2, 2, names=("dp", "tp"))
        tensor_parallel(model, world["tp"])
        dp_mesh = world["dp"]
    else:
        dp_mesh = device_mesh(4, names=("dp",))
    shard(model, functools.partial(fsdp.fully_shard, unit_policy=setup.unit_policy()), dp_mesh)
    per_rank = spec.global_batch // dp_mesh.size()
    rank = dp_mesh.get_local_rank()
    data = batches(spec)[:, rank * per_rank:(rank + 1) * per_rank]
    named = list(model.named_parameters())
    shadow_named = list(shadow.named_parameters())
    opt = setup.make(named)
    shadow_opt = setup.reference(shadow_named, _tp_placements() if tp else {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(setup.steps):
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
        "gathered_warnings": sum(GATHERED in str(w.message) for w in caught),
        "realigned_warnings": sum(REALIGNED in str(w.message) for w in caught),
    }


def _reference(setup: Setup, tp_placements: dict[str, Placement]) -> dict[str, torch.Tensor]:
    """One process, the global batch, the setup's reference optimizer."""
    model = build_model()
    named = list(model.named_parameters())
    opt = setup.reference(named, tp_placements)
    for tokens in batches(TPRunSpec(steps=setup.steps)):
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB),
                        tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in named}


def _fsdp2_tp_oracle(setup: Setup) -> dict[str, torch.Tensor]:
    """Torch's FSDP2 over the same TP plan for forward and backward, each step's gathered
    gradients stepped by the one-process reference optimizer and its parameters written back
    into FSDP2's: the error TP's own arithmetic (not the optimizer) leaves, to hold ours to."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate

    from tests.harness import device_mesh

    spec = TPRunSpec(steps=setup.steps)
    world = device_mesh(2, 2, names=("dp", "tp"))
    model, shadow = build_model(), build_model()
    parallelize(model, world["tp"])
    for block in model.layers:
        fully_shard(block, mesh=world["dp"])
    fully_shard(model, mesh=world["dp"])
    per_rank = spec.global_batch // world["dp"].size()
    rank = world["dp"].get_local_rank()
    data = batches(spec)[:, rank * per_rank:(rank + 1) * per_rank]
    named, shadow_named = list(model.named_parameters()), list(shadow.named_parameters())
    shadow_opt = setup.reference(shadow_named, _tp_placements())
    for step in range(setup.steps):
        tokens = data[step]
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB),
                        tokens[:, 1:].reshape(-1)).backward()
        for (_, p), (_, q) in zip(named, shadow_named):
            q.grad = full(p.grad)
            p.grad = None
        shadow_opt.step()
        with torch.no_grad():
            for (_, p), (_, q) in zip(named, shadow_named):
                whole = DTensor.from_local(q.detach(), p.device_mesh,
                                           [Replicate()] * p.device_mesh.ndim, run_check=False)
                p.copy_(whole)
    return {n: full(p) for n, p in named}


def _error(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((params[n] - ref[n]).abs().max().item() for n in ref)


def _case(setup: Setup) -> dict[str, Any]:
    out = {}
    if setup.optimizer == "adamw8bit":
        out["fsdp2_tp_error"] = _error(_fsdp2_tp_oracle(setup), _reference(setup, _tp_placements()))
    for tp in (True, False):
        ref = _reference(setup, _tp_placements() if tp else {})
        got = _train(setup, tp)
        out["tp" if tp else "dp"] = {
            "bit_equal_misses": got["bit_equal"],
            "error": _error(got["params"], ref),
            "gathered_warnings": got["gathered_warnings"],
            "realigned_warnings": got["realigned_warnings"],
        }
    return out


def _check_parity(setup: Setup, outs: list[dict[str, Any]]) -> None:
    """Bit-equal on identical gradients; the training error within ``SLACK`` x FSDP2 + TP's
    with the same optimizer math where it is measured, else x the dp-only run's (floor 1e-5)."""
    for out in outs:
        tp, dp, oracle = out["tp"], out["dp"], out.get("fsdp2_tp_error")
        print(f"{setup}: error vs one process, TP {tp['error']:.3g}, dp only {dp['error']:.3g}, "
              f"FSDP2 + TP {oracle if oracle is None else format(oracle, '.3g')}")
        assert tp["bit_equal_misses"] == [] and dp["bit_equal_misses"] == [], out
        bound = SLACK * oracle if oracle is not None else max(SLACK * dp["error"], 1e-5)
        assert tp["error"] <= bound, out


@pytest.mark.parametrize("optimizer", ["muon", "shampoo"])
def test_whole_matrix_optimizers_on_tensor_parallel_parameters(ranks, optimizer: str) -> None:
    setup = Setup(optimizer)
    outs = ranks.run(4, _case, setup, timeout=300)
    _check_parity(setup, outs)
    for out in outs:
        assert out["tp"]["gathered_warnings"] > 0 and out["dp"]["gathered_warnings"] == 0, out


@pytest.mark.parametrize("planned", [True, False], ids=["unit_policy", "rows"])
def test_adamw8bit_on_tensor_parallel_parameters(ranks, planned: bool) -> None:
    """Planned: whole blocks on every rank, nothing redistributed. Rows: the dp cuts split
    blocks of the TP-local tensors, which are redistributed along dp (and still bit-equal)."""
    setup = Setup("adamw8bit", planned=planned, steps=5)
    outs = ranks.run(4, _case, setup, timeout=300)
    _check_parity(setup, outs)
    for out in outs:
        assert out["tp"]["gathered_warnings"] == 0, out
        assert (out["tp"]["realigned_warnings"] == 0) == planned, out


@pytest.mark.parametrize("optimizer", ["muon", "shampoo"])
def test_whole_matrix_optimizers_on_uneven_tensor_parallel_parameters(ranks, optimizer: str) -> None:
    """Every TP cut uneven (:class:`tests.fsdp.tp_models.UnevenMLP`): the gathered matrices
    are the whole ones and the results are cut back into each rank's own TP-local run, so
    on identical gradients the parameters equal a one-process optimizer's bit for bit."""
    for out in ranks.run(4, _train, Setup(optimizer, model="uneven"), True, timeout=300):
        assert out["bit_equal"] == [], out["bit_equal"]
        assert out["gathered_warnings"] > 0


def _adamw8bit_on_uneven() -> str:
    import fsdp
    from block_optim import AdamW8bit

    from tests.harness import device_mesh

    build, tensor_parallel, shard, vocab = MODELS["uneven"]
    model = build()
    world = device_mesh(2, 2, names=("dp", "tp"))
    tensor_parallel(model, world["tp"])
    shard(model, fsdp.fully_shard, world["dp"])
    tokens = batches(TPRunSpec(steps=1, model="uneven"))[0, :2]
    F.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
    optimizer = AdamW8bit(list(model.named_parameters()), min_8bit_numel=1)
    with pytest.raises(NotImplementedError, match="uneven cut") as caught:
        optimizer.step()
    return str(caught.value)


def test_adamw8bit_refuses_uneven_tensor_parallel_cuts_on_every_rank(ranks) -> None:
    """Uneven TP ranks would quantize TP-local tensors of different sizes (no global state
    layout): AdamW8bit raises on every rank, naming the parameter, before any collective."""
    messages = ranks.run(4, _adamw8bit_on_uneven, timeout=300)
    assert len(set(messages)) == 1 and "parameter '" in messages[0], messages
