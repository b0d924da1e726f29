"""Fully sharded data parallel training built on RaggedShard and DBuffer.

This package is a skeleton until its issue lands.
"""

__all__: list[str] = []
