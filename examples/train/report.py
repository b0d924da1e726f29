"""What a run leaves behind: the loss curve (PNG) and a sample of generated text."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def plot_losses(history: dict[str, list[list[float]]], path: Path, title: str) -> Path:
    """Write the training and validation loss curves to ``path`` (a PNG).

    Args:
        history: ``{"train": [[step, loss], ...], "val": [[step, loss], ...]}``.
        path: the PNG to write (its directory is created).
        title: the plot's title.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if history["train"]:
        steps, losses = zip(*history["train"])
        ax.plot(steps, losses, lw=1, alpha=0.8, label="train")
    if history["val"]:
        steps, losses = zip(*history["val"])
        ax.plot(steps, losses, "o-", lw=2, label="validation (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, n_bytes: int, seq_len: int, temperature: float,
             seed: int, device: torch.device, multiple: int = 1) -> bytes:
    """Sample ``n_bytes`` bytes after ``prompt`` (greedy when ``temperature`` is 0).

    A sharded forward is a collective: every rank calls this with the same arguments and,
    sampling from the same seeded generator, draws the same bytes. Sequence-parallel layers
    (tensor parallelism) cut the sequence evenly, so the context is right-padded to a
    ``multiple`` of the TP degree: attention is causal, so no real position sees the padding,
    and the last real position's logits are read.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(n_bytes):
        window = tokens[-seq_len:]
        padded = window + [0] * (-len(window) % multiple)
        context = torch.tensor([padded], device=device)
        logits = model(context)[0, len(window) - 1].float().cpu()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=g))
        tokens.append(token)
    return bytes(tokens[len(prompt):])
