"""The tensor-parallel parity model and loop: fsdp and FSDP2 over TP, and one process.

A small Llama-like decoder with odd sizes (hidden 22, 2 heads of 11, SwiGLU width 46 and
vocab 50, whose TP halves 23 and 25 split into uneven whole rows over 2 dp ranks), laid out
with torchtitan's TP plan: embedding ``RowwiseParallel`` (output sequence-sharded),
``SequenceParallel`` RMSNorms, attention q/k/v and SwiGLU gate/up ``ColwiseParallel``, their
output projections ``RowwiseParallel`` back to sequence-sharded, head ``ColwiseParallel`` to
replicated logits. :func:`train` runs the same code for all three: ``impl=None`` on one
process and the whole batch; ``"torch"``/``"fsdp"`` on a ``(dp, tp)`` mesh, each dp rank its
slice of the batch (the tp ranks of one dp rank share it).

:class:`UnevenMLP` (``TPRunSpec(model="uneven")``) cuts unevenly on 2 TP ranks everywhere: an
embedding and head of vocab 25 (13 + 12 rows), a ColwiseParallel ``Linear(6, 13)`` (7 + 6 rows)
and its RowwiseParallel ``Linear(13, 6)`` (7 + 6 columns), and a ``Linear(6, 3)`` pair whose
TP-local tensors are 2 rows and 1 row (the 1-row one sharded alone over 2 dp ranks leaves a dp
rank no units).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, FFN, HEADS, LAYERS, SEQ = 50, 22, 46, 2, 2, 10
SEED = 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        # -1 heads: under TP each rank holds HEADS / tp of them
        q, k, v = (w(x).view(b, s, -1, HIDDEN // HEADS).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_gate = nn.Linear(HIDDEN, FFN, bias=False)
        self.w_up = nn.Linear(HIDDEN, FFN, bias=False)
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


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model() -> Decoder:
    """The same initial weights in every run."""
    torch.manual_seed(SEED)
    return Decoder()


def parallelize(model: Decoder, tp_mesh: Any) -> None:
    """torchtitan's Llama TP plan, sequence parallel between the blocks' matmuls."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w_gate": ColwiseParallel(),
            "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=Shard(1)),
        })


UNEVEN_VOCAB, UNEVEN_HIDDEN, UNEVEN_FFN, UNEVEN_NARROW = 25, 6, 13, 3


class UnevenMLP(nn.Module):
    """Residual MLPs whose every TP cut is uneven on 2 TP ranks (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(UNEVEN_VOCAB, UNEVEN_HIDDEN)
        self.up = nn.Linear(UNEVEN_HIDDEN, UNEVEN_FFN)
        self.down = nn.Linear(UNEVEN_FFN, UNEVEN_HIDDEN)
        self.narrow = nn.Linear(UNEVEN_HIDDEN, UNEVEN_NARROW)
        self.widen = nn.Linear(UNEVEN_NARROW, UNEVEN_HIDDEN)
        self.head = nn.Linear(UNEVEN_HIDDEN, UNEVEN_VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.down(F.gelu(self.up(x)))
        x = x + self.widen(torch.tanh(self.narrow(x)))
        return self.head(x)


def build_uneven() -> UnevenMLP:
    """The same initial weights in every run."""
    torch.manual_seed(SEED)
    return UnevenMLP()


def parallelize_uneven(model: UnevenMLP, tp_mesh: Any) -> None:
    """Megatron's pairs: Colwise then Rowwise; the embedding Rowwise over its vocab rows and
    the head Colwise to replicated logits. A Colwise output stays a DTensor
    (``use_local_output=False``, as in torch's own uneven-TP test model): a local output of
    uneven width would lose its global shape."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel(),
        "narrow": ColwiseParallel(use_local_output=False), "widen": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    })


def shard_uneven(model: UnevenMLP, fully_shard: Any, mesh: Any) -> None:
    """``up``, ``down`` and ``narrow`` each in a group of its own (so ``narrow``'s 1-row
    TP-local weight is cut over the dp ranks alone), then the root."""
    for layer in (model.up, model.down, model.narrow):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _shard_decoder(model: Decoder, fully_shard: Any, mesh: Any) -> None:
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


#: ``TPRunSpec.model``: (build, parallelize, shard, vocab)
MODELS = {
    "decoder": (build_model, parallelize, _shard_decoder, VOCAB),
    "uneven": (build_uneven, parallelize_uneven, shard_uneven, UNEVEN_VOCAB),
}


@dataclass(frozen=True)
class TPRunSpec:
    """One training run: ``steps`` AdamW steps with ``clip_grad_norm_(max_norm=clip)``."""

    steps: int = 10
    global_batch: int = 8
    dp: int = 2
    tp: int = 2
    replicate: int = 1  # > 1: HSDP + TP, fsdp over (dp_replicate, dp_shard)
    lr: float = 1e-2
    clip: float = 0.5
    model: str = "decoder"  # a key of MODELS


def batches(spec: TPRunSpec) -> torch.Tensor:
    """``(steps, global_batch, SEQ + 1)`` tokens, the same in every run."""
    generator = torch.Generator().manual_seed(1234)
    vocab = MODELS[spec.model][3]
    return torch.randint(0, vocab, (spec.steps, spec.global_batch, SEQ + 1), generator=generator)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def train(spec: TPRunSpec, impl: str | None) -> dict[str, Any]:
    """Train and report losses (the global-batch mean), clip norms and full parameters."""
    build, parallelize_model, shard, vocab = MODELS[spec.model]
    model = build()
    data = batches(spec)
    if impl is not None:
        from tests.harness import device_mesh

        if spec.replicate > 1:
            world = device_mesh(spec.replicate, spec.dp, spec.tp,
                                names=("dp_replicate", "dp_shard", "tp"))
            dp_dims: tuple[str, ...] = ("dp_replicate", "dp_shard")
        else:
            world = device_mesh(spec.dp, spec.tp, names=("dp", "tp"))
            dp_dims = ("dp",)
        dp_mesh = world[dp_dims]
        fully_shard = importlib.import_module(
            "torch.distributed.fsdp" if impl == "torch" else "fsdp").fully_shard
        parallelize_model(model, world["tp"])
        shard(model, fully_shard, dp_mesh)
        per_rank = spec.global_batch // (spec.dp * spec.replicate)
        dp_rank = 0
        for dim in dp_dims:  # row-major over the data-parallel dims
            dp_rank = dp_rank * world[dim].size() + world[dim].get_local_rank()
        data = data[:, dp_rank * per_rank:(dp_rank + 1) * per_rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1)
    losses, norms = [], []
    for step in range(spec.steps):
        tokens = data[step]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        optimizer.step()
        optimizer.zero_grad()
        if impl is not None:
            loss = loss.detach().clone()
            for dim in dp_dims:
                dist.all_reduce(loss, group=world[dim].get_group())
            loss /= spec.dp * spec.replicate
        losses.append(loss.item())
        norms.append(_full(norm).item())
    params = {name: _full(p) for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params,
            "placements": {name: str(getattr(p, "placements", None))
                           for name, p in model.named_parameters()}}


def max_param_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest element-wise difference over all parameters (same names required)."""
    assert got.keys() == ref.keys()
    return max((got[n] - ref[n]).abs().max().item() for n in ref)


def max_error(got: list[float], ref: list[float]) -> float:
    """The largest difference between two equally long lists of floats."""
    assert len(got) == len(ref)
    return max(abs(a - b) for a, b in zip(got, ref))
