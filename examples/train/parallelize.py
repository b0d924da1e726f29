"""The one place that shards the model: ``fsdp.fully_shard`` on every block, then the root.

As in torchtitan, each transformer block is its own group (all-gathered just before it runs,
freed after) and the root group holds what is left: the embedding, the final norm and the LM
head. The optimizer decides the unit policy (whole Muon rows and experts, whole Shampoo
blocks, whole 8-bit quantization blocks), so block optimizers see whole blocks on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp


def parallelize(model: nn.Module, mesh: DeviceMesh,
                unit_policy: Callable[[str, torch.Tensor], int] | None,
                param_dtype: torch.dtype | None, *, fp8: bool = False) -> nn.Module:
    """Shard ``model`` (anything with a ``layers`` list of blocks) over ``mesh``.

    Args:
        model: the model, built the same way (same seed) on every rank.
        mesh: a 1-D device mesh over the ranks.
        unit_policy: the optimizer's unit policy, or ``None`` for rows.
        param_dtype: the compute dtype (e.g. ``torch.bfloat16``; gradients are still reduced
            in fp32), or ``None`` for full precision.
        fp8: all-gather each block's Linear weights as block-wise FP8
            (:class:`fsdp.BlockwiseFP8`); the root (embedding, head) stays in ``param_dtype``.

    Returns:
        ``model``, now an ``FSDPModule``.
    """
    mp_policy = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    quantize = fsdp.BlockwiseFP8() if fp8 else None
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh, mp_policy=mp_policy, unit_policy=unit_policy,
                         quantize_all_gather=quantize)
    return fsdp.fully_shard(model, mesh=mesh, mp_policy=mp_policy, unit_policy=unit_policy)
