"""The main job's options: defaults, then a TOML file (``--config``), then the command line.

One dataclass holds every option; the command-line flags are its field names with dashes,
the TOML keys are its field names (dashes or underscores), so the three sources cannot
drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPTIMIZERS = ("adamw", "adamw8bit", "muon", "shampoo")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run needs; the defaults are the README's run (under 3 minutes on 2 cores).

    Attributes:
        optimizer: ``adamw``, ``adamw8bit``, ``muon`` or ``shampoo``.
        world_size: CPU ranks to spawn (ignored under ``torchrun``).
        tp: tensor-parallel degree: the ranks form a ``(world_size / tp, tp)`` mesh, blocks
            use torchtitan's Llama TP plan inside each group of ``tp`` ranks and fsdp shards
            over the data-parallel dimension (1: FSDP only).
        moe_experts: experts of each block's mixture-of-experts feed-forward, replacing the
            dense SwiGLU with ``moe_experts`` SwiGLU experts of width ``ffn_dim`` stored as
            fused 3-D stacks (0: dense).
        moe_top_k: experts each token is routed to (with ``moe_experts``).
        ep: expert-parallel degree (with ``moe_experts``): the ranks also form a
            ``(world_size / ep, ep)`` mesh, each EP rank holds ``moe_experts / ep`` whole
            experts and tokens travel to their expert's rank and back by all-to-all; fsdp
            shards the experts over the other dimension and everything else over all ranks
            (1: every rank computes every expert).
        steps: optimizer steps.
        batch_size: sequences per rank per step.
        seq_len: bytes per sequence.
        dim: model width.
        n_layers: transformer blocks.
        n_heads: attention heads.
        ffn_dim: SwiGLU hidden width.
        lr: peak learning rate (``None``: the optimizer's default, see ``optimizers.py``).
        warmup: linear warm-up steps, then cosine decay to a tenth of the peak.
        weight_decay: decoupled weight decay.
        clip: gradient-norm clipping (0 disables it).
        mixed_precision: ``fp32`` or ``bf16`` (bf16 compute, fp32 gradient reduction).
        fp8: all-gather the blocks' Linear weights as block-wise FP8 (128x128 tiles,
            ``fsdp.BlockwiseFP8``); the modules compute with the dequantized weights.
        data: a text file or a directory of text files (default: the standard library).
        max_bytes: bytes of the corpus to read at most.
        val_fraction: the held-out tail of the corpus.
        val_every: steps between validation passes (also run before the first step and
            after the last).
        val_windows: sequences per validation pass (over all ranks).
        checkpoint_every: steps between checkpoints (0: none).
        keep_checkpoints: checkpoints kept on disk.
        resume: continue from the latest checkpoint under ``out/checkpoints``.
        out: output directory (checkpoints, ``loss.png``).
        sample_bytes: bytes of text generated at the end (0: none).
        prompt: the sample's prompt.
        temperature: the sample's temperature (0: greedy).
        seed: model initialisation, batches and sampling.
    """

    optimizer: str = "adamw"
    world_size: int = 2
    tp: int = 1
    moe_experts: int = 0
    moe_top_k: int = 1
    ep: int = 1
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 352
    lr: float | None = None
    warmup: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    mixed_precision: str = "fp32"
    fp8: bool = False
    data: str | None = None
    max_bytes: int = 4_000_000
    val_fraction: float = 0.05
    val_every: int = 25
    val_windows: int = 64
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    resume: bool = False
    out: str = "runs/train"
    sample_bytes: int = 160
    prompt: str = "def "
    temperature: float = 0.7
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: choose one of "
                             f"{', '.join(PRECISIONS)}")
        if self.tp < 1 or self.n_heads % self.tp or self.ffn_dim % self.tp or self.seq_len % self.tp:
            raise ValueError(f"tp={self.tp} must be >= 1 and divide n_heads={self.n_heads}, "
                             f"ffn_dim={self.ffn_dim} and seq_len={self.seq_len} (tensor "
                             "parallelism cuts whole heads, equal SwiGLU slices and equal "
                             "sequence-parallel slices)")
        if self.tp > 1 and self.fp8:
            raise ValueError(f"tp={self.tp} runs without fp8 (FP8 all-gathers of "
                             "tensor-parallel weights are not supported yet)")
        self._check_experts()
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} heads of "
                             "even width (rotary embeddings rotate pairs)")

    def _check_experts(self) -> None:
        if self.moe_experts < 0 or self.ep < 1:
            raise ValueError(f"moe_experts={self.moe_experts} must be >= 0 and ep={self.ep} >= 1")
        if not self.moe_experts:
            if self.ep > 1:
                raise ValueError(f"--ep {self.ep} needs a mixture of experts: set --moe-experts")
            return
        if self.moe_experts % self.ep:
            raise ValueError(f"--moe-experts {self.moe_experts} must be divisible by --ep "
                             f"{self.ep} (each EP rank holds whole experts)")
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"--moe-top-k {self.moe_top_k} must be in [1, --moe-experts "
                             f"{self.moe_experts}]")
        if self.tp > 1:
            raise ValueError(f"--moe-experts with --tp {self.tp} is not supported yet (the TP "
                             "plan covers the dense SwiGLU only; use --ep to spread experts)")
        if self.fp8 and self.ep > 1:
            raise ValueError(f"--ep {self.ep} runs without --fp8 (the block-wise FP8 all-gather "
                             "does not take expert-parallel DTensor stacks yet; --ep 1 does)")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The run's config from ``argv``: defaults, overridden by ``--config FILE``, overridden by
    the flags given.

    Raises:
        SystemExit: (argparse) for an unknown flag, or a TOML key that is not an option.
    """
    parser = argparse.ArgumentParser(
        prog="hatch run train",
        description="Train a small LLaMA-style byte-level decoder with fsdp.fully_shard.")
    parser.add_argument("--config", type=Path, help="a TOML file of options (keys: the flags' names)")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action="store_true", default=argparse.SUPPRESS)
            continue
        kind = {"int": int, "float": float, "float | None": float}.get(field.type, str)
        choices = {"optimizer": OPTIMIZERS, "mixed_precision": PRECISIONS}.get(field.name)
        parser.add_argument(flag, type=kind, choices=choices, default=argparse.SUPPRESS,
                            help=f"default: {field.default}")
    args = vars(parser.parse_args(argv))
    path = args.pop("config", None)
    options: dict[str, Any] = {}
    if path is not None:
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        for key, value in tomllib.loads(path.read_text()).items():
            name = key.replace("-", "_")
            if name not in names:
                parser.error(f"{path}: unknown option {key!r}")
            options[name] = value
    options.update(args)
    try:
        return TrainConfig(**options)
    except ValueError as error:
        parser.error(str(error))
