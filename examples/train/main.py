"""The main job: train the byte-level decoder with fsdp on every rank, then report.

``hatch run train`` runs :func:`main`: it parses the options, spawns the ranks (or joins
``torchrun``'s) and runs :func:`train` on each. :func:`train` is the whole run on one rank of
an initialised process group: build the model (same seed everywhere), shard it
(:func:`~examples.train.parallelize.parallelize`), build the optimizer, optionally resume,
then step, validate, checkpoint, and at the end plot the loss curve and sample text.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

from fsdp import checkpoint

from examples.train.config import TrainConfig, parse_args
from examples.train.data import ByteData
from examples.train.launch import device, launch
from examples.train.model import Decoder, ModelConfig
from examples.train.optimizers import build_optimizer, unit_policy
from examples.train.parallelize import clip_grad_norm, parallelize
from examples.train.report import generate, plot_losses

LR_KEYS = ("lr", "adamw_lr")
"""The learning rates the schedule scales (Muon's groups carry both)."""


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at the last step."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def mean_over_ranks(total: torch.Tensor, count: torch.Tensor) -> float:
    """``sum(total) / sum(count)`` over all ranks (one all-reduce)."""
    both = torch.stack((total.float(), count.float())).cpu()
    dist.all_reduce(both)
    return float(both[0] / both[1])


def loss_sum(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Summed next-byte cross-entropy of ``batch`` (``[b, seq_len + 1]``)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")


@torch.no_grad()
def validate(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Mean held-out loss per byte over every rank's validation windows."""
    model.eval()
    total, count = torch.zeros(()), torch.zeros(())
    for batch in batches:
        total += loss_sum(model, batch).cpu()
        count += batch[:, 1:].numel()
    model.train()
    return mean_over_ranks(total, count)


def train(config: TrainConfig) -> dict[str, Any]:
    """The whole run on this rank (call on every rank of an initialised process group).

    Returns:
        ``history`` (``{"train": [[step, loss]...], "val": [[step, loss]...]}``, global mean
        losses), ``start_step`` (0, or the resumed step), ``plot`` (the PNG's path, rank 0
        only, else ``None``) and ``sample`` (the generated text).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    lead = rank == 0
    out = Path(config.out)
    data = ByteData.load(config.data, config.seq_len, config.max_bytes, config.val_fraction)
    for flag, degree in (("tp", config.tp), ("ep", config.ep)):
        if world % degree:
            raise ValueError(f"--{flag} {degree} must divide the {world} ranks")
    dp = world // config.tp
    if config.tp > 1:
        world_mesh = init_device_mesh(dev.type, (dp, config.tp), mesh_dim_names=("dp", "tp"))
        mesh, tp_mesh = world_mesh["dp"], world_mesh["tp"]
    else:
        mesh, tp_mesh = init_device_mesh(dev.type, (world,)), None
    # Expert parallelism keeps every rank data-parallel: only the experts use this mesh.
    expert_mesh = (init_device_mesh(dev.type, (world // config.ep, config.ep),
                                    mesh_dim_names=("dp", "ep")) if config.ep > 1 else None)
    if expert_mesh is not None:
        # the experts' gradient norm reduces over both dims: one all-reduce on the flattened
        # dim instead of two in turn (DTensor warns about the latter)
        expert_mesh._flatten("dp_ep")
    # Batches are cut per data-parallel rank: the tp ranks of one group share theirs.
    dp_rank = mesh.get_local_rank()
    val_batches = [b.to(dev) for b in data.val_batches(config.val_windows, config.batch_size, dp_rank, dp)]

    torch.manual_seed(config.seed)
    model_config = ModelConfig(dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
                               ffn_dim=config.ffn_dim, max_seq_len=config.seq_len,
                               n_experts=config.moe_experts, top_k=config.moe_top_k)
    with dev:
        model = Decoder(model_config)
    n_params = sum(p.numel() for p in model.parameters())
    param_dtype = torch.bfloat16 if config.mixed_precision == "bf16" else None
    parallelize(model, mesh, unit_policy(config.optimizer), param_dtype, fp8=config.fp8,
                tp_mesh=tp_mesh, expert_mesh=expert_mesh)
    optimizer = build_optimizer(config.optimizer, model, config.lr, config.weight_decay)
    base_lrs = [{k: g[k] for k in LR_KEYS if k in g} for g in optimizer.param_groups]

    history: dict[str, list[list[float]]] = {"train": [], "val": []}
    start = 0
    checkpoints = out / "checkpoints"
    if config.resume:
        start, extra = checkpoint.load(checkpoints, model, optimizer)
        history = extra["history"]
    elif config.checkpoint_every and lead and checkpoints.exists():
        # A fresh run starts a fresh series (a checkpoint of a step it reaches again would
        # otherwise block the save); --resume is how to continue one.
        shutil.rmtree(checkpoints)
    dist.barrier()
    if lead:
        source = config.data or "the Python standard library's *.py files"
        layout = f"{world} ranks" if tp_mesh is None else f"{world} ranks (dp {dp} x tp {config.tp})"
        if expert_mesh is not None:
            layout += f" (experts: dp {world // config.ep} x ep {config.ep})"
        ffn = (f", MoE {config.moe_experts} experts top-{config.moe_top_k}"
               if config.moe_experts else "")
        print(f"fsdp main job: {layout} ({dist.get_backend()}, {dev.type}), "
              f"{n_params / 1e6:.2f}M-parameter decoder "
              f"({config.n_layers} blocks, dim {config.dim}{ffn}), "
              f"optimizer {config.optimizer}, {config.mixed_precision}"
              f"{', FP8 all-gather' if config.fp8 else ''}\n"
              f"data: {len(data.train) / 1e6:.1f} MB train / {len(data.val) / 1e6:.2f} MB held out "
              f"from {source}" + (f"\nresumed at step {start}" if config.resume else ""),
              flush=True)

    tokens_per_step = config.batch_size * dp * config.seq_len
    bar = tqdm(total=config.steps, initial=start, disable=not lead, desc="train", unit="step",
               dynamic_ncols=True, file=sys.stdout)
    model.train()
    if start == 0:
        history["val"].append([0, validate(model, val_batches)])
    for step in range(start, config.steps):
        t0 = time.perf_counter()
        for group, base in zip(optimizer.param_groups, base_lrs):
            group.update({k: v * lr_factor(step, config) for k, v in base.items()})
        batch = data.train_batch(step, config.batch_size * dp, dp_rank, dp, config.seed).to(dev)
        loss = loss_sum(model, batch) / batch[:, 1:].numel()
        loss.backward()
        if config.clip > 0:
            clip_grad_norm(model.parameters(), config.clip)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = mean_over_ranks(loss.detach(), torch.ones(()))
        history["train"].append([step + 1, mean_loss])
        done = step + 1
        if done % config.val_every == 0 or done == config.steps:
            history["val"].append([done, validate(model, val_batches)])
        if config.checkpoint_every and (done % config.checkpoint_every == 0 or done == config.steps):
            checkpoint.save(checkpoints, model, optimizer, step=done, extra={"history": history},
                            keep_last=config.keep_checkpoints)
        postfix = {"loss": f"{mean_loss:.3f}", "tok/s": f"{tokens_per_step / (time.perf_counter() - t0):,.0f}"}
        if history["val"]:
            postfix["val"] = f"{history['val'][-1][1]:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update()
    bar.close()

    model.eval()
    sample = generate(model, config.prompt.encode(), config.sample_bytes, config.seq_len,
                      config.temperature, config.seed, dev, multiple=config.tp).decode(errors="replace")
    plot = None
    if lead:
        title = f"{config.optimizer}, {world} ranks, {config.steps} steps"
        plot = plot_losses(history, out / "loss.png", title)
        if history["val"]:
            first, last = history["val"][0][1], history["val"][-1][1]
            print(f"held-out loss: {first:.3f} at step {history['val'][0][0]} -> {last:.3f} "
                  f"at step {history['val'][-1][0]} (nats/byte)")
        print(f"loss curve: {plot}")
        if config.sample_bytes:
            print(f"sample (prompt {config.prompt!r}):\n{config.prompt}{sample}", flush=True)
    return {"history": history, "start_step": start, "plot": plot, "sample": sample}


def main(argv: list[str] | None = None) -> None:
    """Parse the options and run :func:`train` on every rank."""
    config = parse_args(argv)
    launch(train, config, config.world_size)
