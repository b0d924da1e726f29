"""The one place that shards the model: tensor parallelism first (``--tp``), then
``fsdp.fully_shard`` on every block and the root over the data-parallel ranks.

As in torchtitan, each transformer block is its own group (all-gathered just before it runs,
freed after) and the root group holds what is left: the embedding, the final norm and the LM
head. The optimizer decides the unit policy (whole Muon rows and experts, whole Shampoo
blocks, whole 8-bit quantization blocks), so block optimizers see whole blocks on every rank.
With tensor parallelism the blocks follow torchtitan's Llama plan (sequence-parallel norms,
column-wise q/k/v and SwiGLU gate/up, row-wise output projections) and fsdp stores the
TP-local weights (:mod:`fsdp.tensor_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp


def parallelize(model: nn.Module, mesh: DeviceMesh,
                unit_policy: Callable[[str, torch.Tensor], int] | None,
                param_dtype: torch.dtype | None, *, fp8: bool = False,
                tp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` (anything with a ``layers`` list of blocks) over ``mesh``.

    Args:
        model: the model, built the same way (same seed) on every rank.
        mesh: the 1-D data-parallel device mesh fsdp shards over.
        unit_policy: the optimizer's unit policy, or ``None`` for rows.
        param_dtype: the compute dtype (e.g. ``torch.bfloat16``; gradients are still reduced
            in fp32), or ``None`` for full precision.
        fp8: all-gather each block's Linear weights as block-wise FP8
            (:class:`fsdp.BlockwiseFP8`); the root (embedding, head) stays in ``param_dtype``.
        tp_mesh: the tensor-parallel mesh of this rank's group (``None``: no TP).

    Returns:
        ``model``, now an ``FSDPModule``.
    """
    if tp_mesh is not None:
        tensor_parallel(model, tp_mesh)
    mp_policy = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    quantize = fsdp.BlockwiseFP8() if fp8 else None
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh, mp_policy=mp_policy, unit_policy=unit_policy,
                         quantize_all_gather=quantize)
    return fsdp.fully_shard(model, mesh=mesh, mp_policy=mp_policy, unit_policy=unit_policy)


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """torchtitan's Llama TP plan: the embedding's output and the norms sequence-parallel,
    attention q/k/v and SwiGLU gate/up column-wise, their output projections row-wise back to
    sequence-sharded activations, the LM head column-wise to replicated logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
