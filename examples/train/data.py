"""Byte-level text data: every machine's Python standard library, or any text files.

The corpus is the bytes of the ``*.py`` files under ``sysconfig``'s ``stdlib`` path (not its
``site-packages``), so every rank and every machine with the same Python reads the same
bytes without a download. Files are read in the order of a hash of their relative paths: a
fixed order that mixes the whole library (sorted order would fill a byte budget with the
first packages alone, and the held-out tail with one package's tables). The last
``val_fraction`` of the bytes is held out. Training batches are windows at positions drawn from a generator seeded by the
step, so a resumed run draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


def corpus_files(data: str | None) -> list[Path]:
    """The files to read, in a fixed mixed order: ``data`` (a file or a directory of text
    files) or the standard library's ``*.py`` files."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in root.rglob("*.py")
                 if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    else:
        root = Path(data)
        if root.is_file():
            return [root]
        files = [p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    if not files:
        raise FileNotFoundError(f"{root}: no {'/'.join(TEXT_SUFFIXES)} files found")
    return sorted(files, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).digest())


def read_corpus(data: str | None, max_bytes: int) -> torch.Tensor:
    """Up to ``max_bytes`` bytes of the corpus, as a ``uint8`` tensor."""
    chunks, total = [], 0
    for path in corpus_files(data):
        chunk = path.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


@dataclass
class ByteData:
    """Train and validation splits of one byte stream, cut into ``seq_len + 1`` windows.

    Attributes:
        train: training bytes.
        val: held-out bytes.
        seq_len: tokens a model sees per sequence (windows hold one more, the last target).
    """

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int

    @classmethod
    def load(cls, data: str | None, seq_len: int, max_bytes: int, val_fraction: float) -> ByteData:
        """Read the corpus and split off the last ``val_fraction`` as validation data."""
        stream = read_corpus(data, max_bytes)
        n_val = max(seq_len + 1, int(len(stream) * val_fraction))
        if len(stream) - n_val < seq_len + 1:
            raise ValueError(f"the corpus holds {len(stream)} bytes: too few for seq_len={seq_len}")
        return cls(stream[:-n_val], stream[-n_val:], seq_len)

    def train_batch(self, step: int, global_batch: int, rank: int, world_size: int,
                    seed: int) -> torch.Tensor:
        """This rank's ``[global_batch // world_size, seq_len + 1]`` slice of step ``step``'s
        batch (int64 tokens)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(self.train) - self.seq_len, (global_batch,), generator=g)
        per_rank = global_batch // world_size
        return self._windows(self.train, starts[rank * per_rank:(rank + 1) * per_rank])

    def val_batches(self, n_windows: int, batch: int, rank: int, world_size: int) -> list[torch.Tensor]:
        """This rank's share of ``n_windows`` evenly spaced validation windows, in batches.

        Every rank gets as many batches as every other (a sharded forward is a collective),
        so ``n_windows`` is rounded down to a multiple of ``world_size``."""
        n_windows = max(world_size, n_windows // world_size * world_size)
        starts = torch.linspace(0, len(self.val) - self.seq_len - 1, n_windows).long()
        mine = starts[rank::world_size]
        return [self._windows(self.val, mine[i:i + batch]) for i in range(0, len(mine), batch)]

    def _windows(self, stream: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.seq_len + 1)
        return stream[starts[:, None] + offsets].long()
