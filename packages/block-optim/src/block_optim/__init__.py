"""block_optim (skeleton; filled by its own issue)."""
