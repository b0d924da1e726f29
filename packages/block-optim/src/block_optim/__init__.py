"""Muon, Shampoo and 8-bit AdamW that are exact on RaggedShard parameters."""

from block_optim.adamw8bit import AdamW8bit
from block_optim.muon import Muon
from block_optim.shampoo import Shampoo

__all__ = ["AdamW8bit", "Muon", "Shampoo"]
