"""dbuffer (skeleton; filled by its own issue)."""
