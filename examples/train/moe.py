"""A mixture-of-experts feed-forward: a top-k router and ``E`` SwiGLU experts stored as fused
3-D stacks, torchtitan's ``GroupedExperts`` layout (``w1``/``w3`` ``[E, ffn, dim]``, ``w2``
``[E, dim, ffn]``).

Plain PyTorch, like :mod:`examples.train.model`: every expert computes where it is. Expert
parallelism (:func:`examples.train.parallelize.expert_parallel`) wraps :class:`GroupedExperts`
from outside, as torchtitan does: it cuts the stacks into whole experts per rank and moves
tokens to their expert's rank and back around the module's forward. The module's one
concession is to compute with the local experts of a stack that arrives as a DTensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts ``w2[e] (silu(w1[e] x) * w3[e] x)`` as fused stacks.

    Args:
        num_experts: experts ``E``.
        dim: model width.
        ffn_dim: each expert's hidden width.
    """

    def __init__(self, num_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``tokens`` (``[rows, dim]``) grouped by expert: the first ``counts[0]`` rows go
        through the first expert held here, the next ``counts[1]`` through the second, ...

        Under expert parallelism the stacks are DTensors ``Shard(0)`` over the EP ranks and
        ``counts`` has one entry per local expert (the token exchange regroups the rows).
        """
        w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1, self.w3, self.w2))
        if counts.numel() != w1.shape[0]:
            raise ValueError(f"GroupedExperts: {counts.numel()} token counts for the "
                             f"{w1.shape[0]} experts held here")
        outs = [F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
                for e, rows in enumerate(tokens.split(counts.tolist()))]
        return torch.cat(outs)


class MoE(nn.Module):
    """Token-choice routing: each token goes to its ``top_k`` highest-scoring experts, whose
    outputs are summed weighted by the router's softmax probabilities (not renormalised, so
    the router learns through them even with ``top_k=1``). No load-balancing loss.

    Args:
        dim: model width.
        ffn_dim: each expert's hidden width.
        num_experts: experts ``E``.
        top_k: experts per token.
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int = 1) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = self.router(tokens).float().softmax(-1)
        gates, expert = scores.topk(self.top_k, dim=-1)            # [tokens, top_k]
        expert = expert.flatten()
        # slots (token, choice) sorted by expert, so each expert sees one contiguous run
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.router.out_features)
        out = self.experts(tokens[order // self.top_k], counts)
        slots = out[torch.argsort(order)].view(-1, self.top_k, x.shape[-1])
        combined = (slots * gates.to(slots.dtype).unsqueeze(-1)).sum(1)
        return combined.view(x.shape)
