"""Let ragged_dtensor install on torch 2.11, for a GPU measurement only.

The GPU image lent to this project has torch 2.11, and ragged_dtensor is written for 2.13 (its
pyproject asks for ``torch>=2.13,<2.14``). Of the torch symbols it replaces, one differs there:
``_FromTorchTensor.forward`` has no ``grad_placements`` parameter in 2.11; every other row's
parameters match (checked on an H100 on 2026-11-28). And dbuffer frees a flat buffer by swapping
its storage's data pointer with a zero-byte storage marked to throw on access
(``UntypedStorage._swap_data_ptr_``, which 2.11 lacks). And fsdp imports
``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.13's full SPMD mesh), which 2.11 lacks;
no other torch name that the packages import is missing there (checked against 2.11's sources).

:func:`install` changes the three in this process: the row expects 2.11's seven parameters
and ragged_dtensor's forward calls 2.11's without ``grad_placements``; a swap between two
zero-byte storages (the only one dbuffer makes with its own allocator: a freed storage and the
marker) does nothing, so a freed buffer is a storage resized to zero bytes, as FSDP2 frees its
own (lost: the mark, which makes a use of a freed view raise, an error check only; a swap that
would move memory, a custom all-gather allocator, raises); and ``DataParallelMeshDims`` is a
stand-in with 2.13's two fields, enough to import fsdp (a benchmark on 2.11 never passes
``dp_mesh_dims``). The package itself still refuses torch 2.11; a benchmark that uses this says
so in its output and checks its training against FSDP2's (a matching signature does not prove matching behaviour).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def _swap_zero_byte_storages(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    if storage.nbytes() or other.nbytes():
        raise NotImplementedError(
            "torch 2.11 has no UntypedStorage._swap_data_ptr_; the torch 2.11 shim stands in "
            "only for a swap of two zero-byte storages (a freed dbuffer storage and its marker)")


@dataclasses.dataclass(frozen=True)
class _DataParallelMeshDims:
    """torch 2.13's fields, so that ``import fsdp`` works; nothing on 2.11 constructs one."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None


def install() -> None:
    """Replace the ``_FromTorchTensor.forward`` row and stand in for the storage swap, for this
    process (before anything installs ragged_dtensor's patches)."""
    import torch.distributed.fsdp as torch_fsdp
    from ragged_dtensor import autograd_hooks, torch_patches

    symbol = "torch.distributed.tensor._api._FromTorchTensor.forward"
    if not torch.__version__.startswith("2.11"):
        raise RuntimeError(f"the torch 2.11 shim is for torch 2.11, this is {torch.__version__}")
    original = torch_patches.torch_original(symbol)

    def forward_211(ctx: Any, input: torch.Tensor, device_mesh: Any, placements: tuple,
                    run_check: bool, shape: Any, stride: Any, grad_placements: Any) -> Any:
        if grad_placements is not None:
            raise NotImplementedError("torch 2.11's from_local has no grad_placements")
        return original(ctx, input, device_mesh, placements, run_check, shape, stride)

    autograd_hooks._ORIGINAL_FORWARD = forward_211
    torch.UntypedStorage._swap_data_ptr_ = _swap_zero_byte_storages
    if not hasattr(torch_fsdp, "DataParallelMeshDims"):
        torch_fsdp.DataParallelMeshDims = _DataParallelMeshDims
    torch_patches.PATCHES = tuple(
        dataclasses.replace(p, parameters=p.parameters[:-1]) if p.symbol == symbol else p
        for p in torch_patches.PATCHES)
