"""The TP-local tensors of a full tensor as torch cuts them: the independent reference the
block-optim and fsdp tensor-parallel tests compare each rank's TP-local state against."""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Placement, Shard


def tp_local_pieces(full: torch.Tensor, placement: Placement | None,
                    tp: int) -> list[torch.Tensor]:
    """The TP-local tensors of ``full`` in TP-rank order: ``torch.chunk`` views along a TP
    ``Shard``'s dim (even or uneven, as DTensor cuts), ``full`` itself for any other (or no)
    placement. Views: a caller that steps them clones first."""
    if isinstance(placement, Shard):
        return list(full.chunk(tp, dim=placement.dim))
    return [full]
