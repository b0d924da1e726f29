"""The optimizer options of the main job and the unit policy each asks of fsdp.

Muon orthogonalizes the blocks' matrices; the embedding, the LM head and the norms go to its
internal AdamW, as in Muon's reference recipe. The block optimizers' ``unit_policy()`` is
what ``parallelize`` passes to ``fully_shard``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

DEFAULT_LR = {"adamw": 3e-3, "adamw8bit": 3e-3, "muon": 0.02, "shampoo": 3e-3}
SHAMPOO_BLOCK = 128


def unit_policy(name: str) -> Callable[[str, torch.Tensor], int] | None:
    """The unit policy of optimizer ``name`` (``None``: fsdp's default, rows)."""
    from block_optim import AdamW8bit, Muon, Shampoo

    policies = {"adamw8bit": AdamW8bit.unit_policy, "muon": Muon.unit_policy,
                "shampoo": lambda: Shampoo.unit_policy(SHAMPOO_BLOCK)}
    return policies[name]() if name in policies else None


def build_optimizer(name: str, model: nn.Module, lr: float | None,
                    weight_decay: float) -> torch.optim.Optimizer:
    """Optimizer ``name`` over ``model``'s (sharded) parameters, with their names."""
    from block_optim import AdamW8bit, Muon, Shampoo

    lr = DEFAULT_LR[name] if lr is None else lr
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(named, lr=lr, weight_decay=weight_decay)
    if name == "adamw8bit":
        return AdamW8bit(named, lr=lr, weight_decay=weight_decay)
    if name == "shampoo":
        return Shampoo(named, lr=lr, weight_decay=weight_decay,
                       max_preconditioner_dim=SHAMPOO_BLOCK)
    matrices = [(n, p) for n, p in named if n.startswith("layers.") and p.dim() >= 2]
    rest = [(n, p) for n, p in named if not (n.startswith("layers.") and p.dim() >= 2)]
    return Muon([{"params": matrices}, {"params": rest, "use_muon": False}], lr=lr,
                weight_decay=weight_decay, adamw_lr=DEFAULT_LR["adamw"],
                adamw_weight_decay=weight_decay)
