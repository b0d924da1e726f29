"""Make the tensors a DBuffer handed out raise while their memory is freed.

Freeing resizes a flat buffer's storage to zero bytes in place, so that views handed out
earlier (fsdp registers them as module parameters, autograd saves them) stay the same objects
and see the new memory after the next gather. Between free and re-allocation those views
point at no memory, and torch's CPU kernels do not check that: reading one at a non-zero
storage offset dereferences ``nullptr + offset`` and kills the process (exit 139).

No storage-level switch makes *reads* of a CPU storage raise from Python (the
``throw_on_immutable_data_ptr`` flag of ``c10::StorageImpl`` has only a CUDA binding), so two
mechanisms are combined:

* every tensor object DBuffer handed out is switched, in place, to the
  :class:`FreedTensor` class while freed (a RaggedShard DTensor over one of its views to
  :class:`FreedDTensor`). Its ``__torch_function__`` raises
  :class:`~dbuffer.errors.FreedBufferError` naming the tensor for every torch function,
  method, operator, ``print`` and property that touches data, and passes through pure
  metadata (shape, dtype, device, ``untyped_storage``, hashing, a DTensor's placements).
  Re-allocation switches it back: the Python object, its autograd version counter and its
  storage never change. A DTensor's local tensor is DBuffer's view itself
  (:func:`ragged_dtensor.from_local_run`), so ``dt.to_local()`` is fenced too.
* the storage itself is marked to throw on any *mutable* data access while freed (by swapping
  its empty data pointer with one taken from a marked zero-byte storage, and swapping back on
  re-allocation), so writes through *other* aliases (``nn.Parameter(view)``, a ``detach()``
  taken before the free, autograd accumulating into a ``.grad`` alias) raise too.

Not covered (documented): reads through an alias DBuffer did not hand out (such as the new
view ``DTensor.to_local()`` returns for autograd while grad mode is on), which still crash
on CPU, and C++ code reading the handed-out object directly (autograd running a backward
whose saved tensor is freed, ``torch.tensor(view)``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dbuffer.errors import FreedBufferError

_MESSAGE = "_dbuffer_freed_message"


def _metadata_functions() -> frozenset[Any]:
    base = torch._C.TensorBase
    getters = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "grad",
               "ndim", "layout", "is_cuda", "is_meta", "_base", "_version")
    return frozenset(
        [torch.Tensor.__hash__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.stride,
         torch.Tensor.numel, torch.Tensor.storage_offset, torch.Tensor.untyped_storage,
         torch.Tensor.data_ptr, torch.Tensor.is_contiguous, torch.Tensor.element_size,
         torch.Tensor.requires_grad_]
        + [getattr(base, name).__get__ for name in getters]
        + [base.grad.__set__, base.requires_grad.__set__])


def _refuse(func: Any, args: Any, kwargs: Any) -> Any:
    """Run ``func`` if it only reads metadata, else raise naming the freed tensor."""
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    freed = [a for a in _flatten(args, kwargs) if is_released(a)]
    message = getattr(freed[0], _MESSAGE, None) if freed else None
    name = getattr(func, "__name__", str(func))
    raise FreedBufferError(f"{name}(): {message or 'a DBuffer view is used while freed'}")


class FreedTensor(torch.Tensor):
    """The class a handed-out view has while its memory is freed (never constructed)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return _refuse(func, args, kwargs)


class FreedDTensor(DTensor):
    """The class a handed-out DTensor has while its local view is freed (never constructed).

    Torch functions raise as for :class:`FreedTensor`; the DTensor methods that run
    collectives raise before any communication (every rank frees together, so every rank
    raises); ``to_local`` returns the fenced local view itself, whose uses raise.
    """

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return _refuse(func, args, kwargs)

    def to_local(self, *, grad_placements: Any = None) -> torch.Tensor:
        return self._local_tensor

    def redistribute(self, *args: Any, **kwargs: Any) -> DTensor:
        raise FreedBufferError(f"redistribute(): {getattr(self, _MESSAGE)}")

    def full_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise FreedBufferError(f"full_tensor(): {getattr(self, _MESSAGE)}")


_METADATA: frozenset[Any] = _metadata_functions()


def _flatten(args: Any, kwargs: Any) -> list[Any]:
    out: list[Any] = []
    stack = [args, list((kwargs or {}).values())]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            out.append(item)
    return out


def fence(tensor: torch.Tensor, message: str) -> None:
    """Make every data use of ``tensor`` raise :class:`FreedBufferError` with ``message``.

    Args:
        tensor: a plain tensor (or a subclass with an instance ``__dict__``) or a DTensor.
        message: what the error says (which tensor, which buffer, what to call first).
    """
    if isinstance(tensor, (FreedTensor, FreedDTensor)):
        return
    label(tensor, message)
    tensor.__class__ = fenced_class(tensor)


def label(tensor: torch.Tensor, message: str) -> None:
    """Give ``tensor`` the message its fence raises with, ahead of any fence: a buffer whose
    views are fenced and unfenced every step (:class:`dbuffer.flat.FlatBuffer`) labels each
    once, when it is handed out, and then only switches classes (:func:`fenced_class`) back
    and forth: a class switch costs a fraction of setting attributes on the tensor.

    Args:
        tensor: a plain tensor (or a subclass with an instance ``__dict__``) or a DTensor.
        message: what the error says while it is fenced.
    """
    setattr(tensor, _MESSAGE, message)


def fenced_class(tensor: torch.Tensor) -> type[torch.Tensor]:
    """The class ``tensor`` has while fenced: :class:`FreedDTensor` for a DTensor, else
    :class:`FreedTensor`."""
    return FreedDTensor if isinstance(tensor, DTensor) else FreedTensor


def release_in_place(tensors: list[torch.Tensor], message: str) -> None:
    """Free the memory behind ``tensors`` now, whoever else holds the objects, and make every
    later data use of them raise :class:`~dbuffer.errors.FreedBufferError` with ``message``.

    For memory that a set of views owns by reference (fsdp's sharded gradients) when the
    views must stay in place but their values are spent: fsdp's memory-first mode steps a
    group's parameters inside backward and releases their gradients this way, so a later
    ``clip_grad_norm_`` or ``optimizer.step()`` that would silently see nothing raises
    instead. Each storage is resized to zero bytes once; a DTensor's local tensor is fenced
    with it.

    Args:
        tensors: plain tensors or DTensors (views of one or more storages).
        message: what the error says when one is used.
    """
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage._cdata] = storage
        fence(tensor, message)
        if local is not tensor:
            fence(local, message)
    for storage in storages.values():
        storage.resize_(0)


def metadata_access() -> AbstractContextManager[object]:
    """A context in which handed-out tensors' metadata (``.grad`` read or cleared, storage
    identity, version) is read without the fence's torch-function round trip.

    The fence lets metadata through anyway; per-step loops over every tensor of a buffer
    (DBuffer's and fsdp's ``.grad`` bookkeeping) would otherwise pay the round trip once per
    tensor. Inside it a fenced tensor is not guarded, so it must only touch metadata: data
    uses (a copy, an add) go outside it.
    """
    return torch._C.DisableTorchFunctionSubclass()


def is_released(tensor: object) -> bool:
    """Whether ``tensor`` is fenced: freed by its DBuffer or by :func:`release_in_place`.

    Args:
        tensor: any object.

    Returns:
        True for a tensor whose data uses raise :class:`~dbuffer.errors.FreedBufferError`.
    """
    return isinstance(tensor, (FreedTensor, FreedDTensor))
