"""ragged_dtensor (skeleton; filled by its own issue)."""
