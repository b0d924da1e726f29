"""A small LLaMA-style decoder: RMSNorm, rotary attention, SwiGLU (or a mixture of SwiGLU
experts, :mod:`examples.train.moe`), untied LM head.

Plain PyTorch that knows nothing of sharding: :mod:`examples.train.parallelize` is the one
place that wraps it, as torchtitan keeps its models and its parallelisms apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from examples.train.moe import MoE


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape.

    Attributes:
        vocab_size: tokens (256 for bytes).
        dim: model width.
        n_layers: transformer blocks.
        n_heads: attention heads (``dim`` divisible by it).
        ffn_dim: SwiGLU hidden width.
        max_seq_len: longest sequence the rotary table covers.
        rope_theta: rotary base.
        n_experts: experts of each block's mixture-of-experts feed-forward (0: the dense
            SwiGLU); each expert is a SwiGLU of width ``ffn_dim``.
        top_k: experts per token (with ``n_experts``).
    """

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 352
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    n_experts: int = 0
    top_k: int = 1


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * rms).to(x.dtype) * self.weight


def rotary_table(config: ModelConfig) -> torch.Tensor:
    """``[max_seq_len, head_dim // 2, 2]``: cos and sin of every position's rotation angles."""
    head_dim = config.dim // config.n_heads
    freqs = config.rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x``'s last dim (``[batch, heads, seq, head_dim]``) by position."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = table[: x.shape[-2], :, 0], table[: x.shape[-2], :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # -1 heads: under tensor parallelism each rank computes n_heads / tp of them
        q, k, v = (w(x).view(b, s, -1, d // self.n_heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: attention, then feed-forward (``feed_forward``, or ``moe``
    with ``n_experts``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(config.dim), Attention(config)
        self.ffn_norm = RMSNorm(config.dim)
        if config.n_experts:
            self.moe = MoE(config.dim, config.ffn_dim, config.n_experts, config.top_k)
        else:
            self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rotary)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm, LM head; returns logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("rotary", rotary_table(config), persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # Small normal init, residual projections scaled by depth (as in GPT-2 and torchtitan).
        residual = ("wo.weight", "w2.weight", "experts.w2")
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # matrices and expert stacks
                std = 0.02 / (2 * self.config.n_layers) ** 0.5 if name.endswith(residual) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rotary)
        return self.output(self.norm(x))
