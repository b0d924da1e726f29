"""The one place that shards the model: tensor parallelism first (``--tp``), then
``fsdp.fully_shard`` on every block and the root over the data-parallel ranks.

As in torchtitan, each transformer block is its own group (all-gathered just before it runs,
freed after) and the root group holds what is left: the embedding, the final norm and the LM
head. The optimizer decides the unit policy (whole Muon rows and experts, whole Shampoo
blocks, whole 8-bit quantization blocks), so block optimizers see whole blocks on every rank.
With tensor parallelism the blocks follow torchtitan's Llama plan (sequence-parallel norms,
column-wise q/k/v and SwiGLU gate/up, row-wise output projections) and fsdp stores the
TP-local weights (:mod:`fsdp.tensor_parallel`). With expert parallelism (``--ep``) the
mixture-of-experts stacks are cut into whole experts over the ``ep`` mesh dim and each block's
experts are a group of their own, sharded over the ``dp`` dim of that mesh, while everything
else is sharded over all ranks (torchtitan's layout, ``tests/fsdp/test_expert_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

import fsdp

from examples.train.moe import GroupedExperts


def parallelize(model: nn.Module, mesh: DeviceMesh,
                unit_policy: Callable[[str, torch.Tensor], int] | None,
                param_dtype: torch.dtype | None, *, fp8: bool = False,
                tp_mesh: DeviceMesh | None = None,
                expert_mesh: DeviceMesh | None = None) -> nn.Module:
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
        expert_mesh: a 2-D ``("dp", "ep")`` mesh over the same ranks as ``mesh``: the expert
            stacks go ``Shard(0)`` over ``ep`` (:func:`expert_parallel`) and each block's
            experts are sharded by fsdp over ``dp`` (``None``: no expert parallelism; experts
            are sharded with the rest of their block).

    Returns:
        ``model``, now an ``FSDPModule``.
    """
    if tp_mesh is not None:
        tensor_parallel(model, tp_mesh)
    mp_policy = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    quantize = fsdp.BlockwiseFP8() if fp8 else None
    if expert_mesh is not None:
        for experts in expert_parallel(model, expert_mesh["ep"]):
            fsdp.fully_shard(experts, mesh=expert_mesh["dp"], mp_policy=mp_policy,
                             unit_policy=unit_policy)
            # An expert's gradient already sums the tokens of its whole EP group (the token
            # all-to-all's backward); summed over dp it holds every rank's share, so it is
            # averaged over all ranks, not the dp ranks fsdp reduces over.
            experts.set_gradient_divide_factor(float(expert_mesh.size()))
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh, mp_policy=mp_policy, unit_policy=unit_policy,
                         quantize_all_gather=quantize)
    return fsdp.fully_shard(model, mesh=mesh, mp_policy=mp_policy, unit_policy=unit_policy)


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """torchtitan's Llama TP plan: the embedding's output and the norms sequence-parallel,
    attention q/k/v and SwiGLU gate/up column-wise, their output projections row-wise back to
    sequence-sharded activations, the LM head column-wise to replicated logits."""
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


def expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Expert parallelism for every :class:`~examples.train.moe.GroupedExperts` in ``model``.

    Each fused stack becomes a DTensor ``Shard(0)`` over ``ep_mesh`` (EP rank ``r`` holds
    experts ``r * E / ep`` to ``(r + 1) * E / ep - 1``, whole), and the module's forward is
    wrapped in a token exchange (:class:`TokenAllToAll`). Call it before ``fully_shard``.

    Args:
        model: the model, built the same way (same seed) on every rank.
        ep_mesh: the 1-D expert-parallel mesh of this rank's EP group.

    Returns:
        the wrapped expert modules.

    Raises:
        ValueError: if a module's experts do not split evenly over ``ep_mesh``.
    """
    found = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for experts in found:
        if experts.w1.shape[0] % ep_mesh.size():
            raise ValueError(f"expert_parallel: {experts.w1.shape[0]} experts do not split "
                             f"evenly over {ep_mesh.size()} EP ranks")
        exchange = TokenAllToAll(ep_mesh.get_group())
        distribute_module(experts, ep_mesh, _shard_experts, exchange.dispatch, exchange.combine)
    return found


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(param.detach(), mesh,
                                                                      [Shard(0)])))


class TokenAllToAll:
    """The token exchange around one expert module under expert parallelism.

    Before the experts run (:meth:`dispatch`): the per-expert token counts go to every EP
    rank (an all-to-all of integers), then each token to the rank holding its expert
    (``all_to_all_single_autograd``, so gradients travel back the same way), regrouped by
    local expert. After (:meth:`combine`): the outputs return to their tokens' ranks in the
    order they left. The split sizes of one forward are kept for its :meth:`combine`.

    Args:
        group: the EP process group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._splits: tuple[list[int], list[int]] | None = None
        self._order: torch.Tensor | None = None

    def dispatch(self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor],
                 mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens grouped by global expert, counts per global expert)`` in, the same for
        this rank's experts out."""
        tokens, counts = inputs
        ep = dist.get_world_size(self.group)
        send = counts.view(ep, -1)  # row r: the counts for EP rank r's experts
        recv = torch.empty_like(send)  # row r: what EP rank r sends for this rank's experts
        dist.all_to_all_single(recv, send, group=self.group)
        sent, received = send.sum(1).tolist(), recv.sum(1).tolist()
        self._splits = (sent, received)
        arrived = all_to_all_single_autograd(tokens, received, sent, self.group)
        local = torch.arange(send.shape[1], device=counts.device).repeat(ep)
        self._order = torch.argsort(torch.repeat_interleave(local, recv.flatten()), stable=True)
        return arrived[self._order], recv.sum(0)

    def combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """This rank's experts' outputs back to the ranks and order their tokens came in."""
        if self._splits is None or self._order is None:
            raise RuntimeError("TokenAllToAll.combine without a dispatch before it")
        sent, received = self._splits
        by_source = output[torch.argsort(self._order)]
        self._splits = self._order = None
        return all_to_all_single_autograd(by_source, sent, received, self.group)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several device meshes.

    Expert parallelism puts the expert stacks on the ``(dp, ep)`` mesh and everything else on
    the mesh of all ranks; torch's version stacks the per-tensor norms, which DTensor refuses
    across meshes. Here each mesh's norm is reduced to a plain tensor first (in the order the
    parameters come, the same on every rank), then each mesh's grads are scaled by the total.

    Args:
        parameters: the model's parameters (sharded or not).
        max_norm: the largest total 2-norm of the gradients.

    Returns:
        the total 2-norm before clipping (a plain tensor).
    """
    by_mesh: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in by_mesh.values():  # one mesh per call: DTensor's foreach ops need that
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
