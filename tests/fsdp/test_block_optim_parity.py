"""Muon, Shampoo and AdamW8bit on sharded parameters against the same optimizer in one process.

fsdp plans its buffer with the optimizer's ``unit_policy`` (``fully_shard(...,
unit_policy=Opt.unit_policy())``), so every rank holds whole Newton-Schulz matrices rows,
Shampoo blocks and quantization blocks; FSDP2 (``impl="torch"``, the oracle) shards rows
evenly and block-optim redistributes where a cut splits a unit. Two checks per run:

* **The optimizer is exact.** Forward and backward are not bit-exact across world sizes (the
  gradient sum runs in another order), so exactness is checked on identical gradients: every
  step, each rank gathers the sharded gradients and steps a one-process copy of the optimizer
  with them; after all steps the sharded parameters must be *bit-equal* (``torch.equal``) to
  that copy's (Muon with fp32 Newton-Schulz, Shampoo in fp32, AdamW8bit).
* **The unit policy is honoured.** With fsdp no rank cut splits a unit, so block-optim never
  warns that it must redistribute around the step; with FSDP2's even row split it does for
  Shampoo blocks and 8-bit quantization blocks (Muon moves whole matrices either way).
* **Training matches one process.** Against the one-process run on the full batch (its own
  forward and backward): losses and parameters no further than FSDP2's with the same
  optimizer at the same world size (``SLACK`` x its error + a float-noise floor).
  Normalizing optimizers (Muon's orthogonalization, 8-bit quantization, Shampoo's inverse
  roots) turn last-bit gradient differences into visible differences (FSDP2's Shampoo
  losses drift ~4e-4 from one process): how far is a random draw of the summation order,
  hence a factor of 2 rather than 1.

Four steps (Shampoo preconditions from step 2, every 2 steps) at world sizes 2 and 3 keep the
8-bit path, which runs in plain torch on CPU, within the suite's budget; world sizes 1 and 4
are covered by the SGD/AdamW parity tests.
"""

from __future__ import annotations

import pytest
import torch

from tests.fsdp.models import RunSpec, max_loss_error, max_param_error
from tests.fsdp.test_parity import IMPLS, reference, sharded

SPECS = {name: RunSpec(name, steps=4, shadow=True) for name in ("muon", "shampoo", "adamw8bit")}
SLACK = 2.0
LOSS_ABS, PARAM_ABS = 1e-5, 1e-6
WORLD_SIZES = (2, 3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("optimizer", sorted(SPECS))
def test_block_optimizer_parity(ranks, optimizer: str, world_size: int, impl: str) -> None:
    spec = SPECS[optimizer]
    got = sharded(ranks, spec, impl, world_size)
    for name, shadow in got["shadow_params"].items():
        assert torch.equal(got["params"][name], shadow), (name, optimizer)

    if impl == "fsdp":
        assert got["unit_warnings"] == []
    elif optimizer != "muon":
        assert got["unit_warnings"], optimizer

    ref = reference(spec)
    oracle = sharded(ranks, spec, "torch", world_size)
    for measure, key, floor in ((max_loss_error, "losses", LOSS_ABS),
                                (max_param_error, "params", PARAM_ABS)):
        ours, theirs = measure(got[key], ref[key]), measure(oracle[key], ref[key])
        assert ours <= SLACK * theirs + floor, (key, ours, theirs)
        assert theirs <= 1e-2, (key, theirs)  # FSDP2 itself trains like one process
