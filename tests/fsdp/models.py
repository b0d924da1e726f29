"""The parity tests' model and training loop, shared by FSDP2, fsdp and the one-process run.

One function, :func:`train`, trains the tiny decoder. With ``impl=None`` it runs in one
process on the full batch (the reference); with ``impl="torch"`` or ``impl="fsdp"`` it runs on
every gloo rank, wraps the model with that implementation's ``fully_shard`` (each block, then
the root, as torchtitan does) and trains on the rank's slice of the same batch. Everything
else is the same code, so any difference between the runs comes from the sharding system.

The model is chosen to leave nothing even: hidden 100, vocab 257 and an SwiGLU width of 172
divide by none of the world sizes 2, 3, 4 into whole rows; the embedding and the LM head
share one weight; a frozen positional table sits in the root group next to trainable
parameters; each attention module holds a causal-mask buffer.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, FFN, HEADS, LAYERS, SEQ = 257, 100, 172, 4, 2, 16
SEED = 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        return (x.float() * rms).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wv = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=True)
        self.register_buffer("causal", torch.ones(SEQ, SEQ, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-1, -2)) / (HIDDEN // HEADS) ** 0.5
        scores = scores.masked_fill(~self.causal[:s, :s], float("-inf"))
        out = scores.softmax(-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, HIDDEN))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_gate = nn.Linear(HIDDEN, FFN, bias=False)
        self.w_up = nn.Linear(HIDDEN, FFN, bias=True)
        self.w_down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(HIDDEN), Attention()
        self.mlp_norm, self.mlp = RMSNorm(HIDDEN), SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyDecoder(nn.Module):
    """Decoder-only transformer with tied embedding / LM head and a frozen position table."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        nn.init.normal_(self.embed.weight, std=0.1)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, HIDDEN), requires_grad=False)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model() -> TinyDecoder:
    """The model with the same initial weights on every rank and in every run."""
    torch.manual_seed(SEED)
    return TinyDecoder()


@dataclass(frozen=True)
class RunSpec:
    """One training run; hashable, so the one-process reference is computed once per spec.

    Attributes:
        optimizer: ``"sgd"`` (momentum 0.9), ``"adamw"``, ``"muon"``, ``"shampoo"`` or
            ``"adamw8bit"``.
        steps: optimizer steps.
        global_batch: sequences per step over all ranks (divisible by world size x
            ``micro_batches``).
        micro_batches: gradient-accumulation micro-batches per step; every one but the last
            runs with ``set_requires_gradient_sync(False)``.
        bf16: bf16 compute with fp32 gradient reduction (sharded runs only; the reference
            stays fp32).
        clip: ``max_norm`` for ``clip_grad_norm_`` before each step (None: no clipping).
        shadow: also step a one-process copy of the optimizer, on rank 0, on the gathered
            gradients of each step (the optimizer-exactness check of the block-optim tests).
    """

    optimizer: str = "sgd"
    steps: int = 10
    global_batch: int = 12
    micro_batches: int = 1
    bf16: bool = False
    clip: float | None = None
    shadow: bool = False


SHAMPOO_ARGS: dict[str, Any] = {"max_preconditioner_dim": 64, "precondition_frequency": 2,
                                "start_preconditioning_step": 2}
"""Small blocks and early, frequent preconditioning, so that a few steps exercise them."""


def make_optimizer(spec: RunSpec, params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The spec's optimizer over ``params`` (named, trainable)."""
    if spec.optimizer == "sgd":
        return torch.optim.SGD([p for _, p in params], lr=0.05, momentum=0.9)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in params], lr=3e-3, weight_decay=0.01)
    from block_optim import AdamW8bit, Muon, Shampoo

    if spec.optimizer == "muon":
        return Muon(params, lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)
    if spec.optimizer == "shampoo":
        return Shampoo(params, lr=3e-3, **SHAMPOO_ARGS)
    if spec.optimizer == "adamw8bit":
        return AdamW8bit(params, lr=3e-3)
    raise ValueError(f"unknown optimizer {spec.optimizer!r}")


def unit_policy(optimizer: str) -> Callable[[str, torch.Tensor], int] | None:
    """The block-optim optimizer's unit policy for fsdp's planner (None for torch optimizers)."""
    if optimizer not in ("muon", "adamw8bit", "shampoo"):
        return None
    from block_optim import AdamW8bit, Muon, Shampoo

    return {"muon": Muon.unit_policy(), "adamw8bit": AdamW8bit.unit_policy(),
            "shampoo": Shampoo.unit_policy(SHAMPOO_ARGS["max_preconditioner_dim"])}[optimizer]


def batches(spec: RunSpec) -> torch.Tensor:
    """``[steps, global_batch, SEQ + 1]`` tokens, the same in every run of the spec."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(VOCAB, (spec.steps, spec.global_batch, SEQ + 1), generator=g)


def import_fsdp(impl: str) -> Any:
    """The module ``fully_shard`` and ``MixedPrecisionPolicy`` come from for ``impl``."""
    return importlib.import_module({"torch": "torch.distributed.fsdp", "fsdp": "fsdp"}[impl])


def shard(model: TinyDecoder, impl: str, spec: RunSpec, mesh: Any) -> None:
    """Wrap like torchtitan: every block, then the root (embedding, tied head, norm, pos)."""
    api = import_fsdp(impl)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if spec.bf16:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
    if impl == "fsdp" and unit_policy(spec.optimizer) is not None:
        kwargs["unit_policy"] = unit_policy(spec.optimizer)
    for layer in model.layers:
        api.fully_shard(layer, **kwargs)
    api.fully_shard(model, **kwargs)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``full_tensor()`` of a DTensor, a detached copy otherwise."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def sharded_steps(model: nn.Module, optimizer: torch.optim.Optimizer, spec: RunSpec, first: int,
                  last: int) -> list[float]:
    """Steps ``[first, last)`` of ``spec``'s batches on this rank's slice of each (call it on
    every rank); the mean loss of each step over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = spec.global_batch // world
    losses = []
    for tokens in batches(spec)[first:last]:
        loss = _loss(model, tokens[rank * per_rank:(rank + 1) * per_rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(float(loss / world))
    return losses


def _set_sync(model: nn.Module, sync: bool) -> None:
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def train(spec: RunSpec, impl: str | None) -> dict[str, Any]:
    """Train per ``spec``; sharded when ``impl`` is given (call it on every rank then).

    Returns:
        ``losses`` (the full-batch mean loss of each step, averaged over ranks), ``norms``
        (``clip_grad_norm_``'s total norms), ``params`` (name -> whole final parameter, fp32),
        ``unit_warnings`` (block-optim's warnings that a rank cut splits one of its units, so
        it redistributes around every step: they name ``unit_policy``), and with
        ``spec.shadow`` ``shadow_params`` (the one-process optimizer's parameters after being
        stepped on the same gathered gradients).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train(spec, impl)
    out["unit_warnings"] = sorted({str(w.message) for w in caught
                                   if "unit_policy" in str(w.message)})
    return out


def _train(spec: RunSpec, impl: str | None) -> dict[str, Any]:
    model = build_model()
    rank, world = (dist.get_rank(), dist.get_world_size()) if impl else (0, 1)
    shadow = build_model() if spec.shadow and rank == 0 else None
    if impl:
        from tests.harness import device_mesh

        shard(model, impl, spec, device_mesh(world))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = make_optimizer(spec, named)
    if shadow is not None:
        shadow_named = [(n, p) for n, p in shadow.named_parameters() if p.requires_grad]
        shadow_optimizer = make_optimizer(spec, shadow_named)
    per_rank = spec.global_batch // world
    micro = per_rank // spec.micro_batches
    assert per_rank * world == spec.global_batch and micro * spec.micro_batches == per_rank
    losses, norms = [], []
    for tokens in batches(spec):
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        step_loss = torch.zeros(())
        for m in range(spec.micro_batches):
            _set_sync(model, m == spec.micro_batches - 1)
            loss = _loss(model, mine[m * micro:(m + 1) * micro]) / spec.micro_batches
            loss.backward()
            step_loss += loss.detach().float()
        if spec.clip is not None:
            norms.append(float(full(torch.nn.utils.clip_grad_norm_(
                [p for _, p in named], spec.clip))))
        if spec.shadow:
            grads = [full(p.grad) for _, p in named]  # a collective: every rank gathers
            if shadow is not None:
                for (_, q), grad in zip(shadow_named, grads):
                    q.grad = grad
                shadow_optimizer.step()
        optimizer.step()
        optimizer.zero_grad()
        if impl:
            dist.all_reduce(step_loss)
            step_loss /= world
        losses.append(float(step_loss))
    out: dict[str, Any] = {
        "losses": losses, "norms": norms,
        "params": {n: full(p).float() for n, p in model.named_parameters()},
    }
    if shadow is not None:
        out["shadow_params"] = {n: p.detach().clone() for n, p in shadow.named_parameters()}
    return out


def max_param_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over every parameter (names must match)."""
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    return max(float((got[n] - ref[n]).abs().max()) for n in ref)


def max_loss_error(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref)
    return max(abs(a - b) for a, b in zip(got, ref))
