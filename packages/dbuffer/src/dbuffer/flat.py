"""One flat buffer whose memory can be released and restored without replacing the tensor.

Views of a DBuffer are handed out once and kept (FSDP registers them as module parameters),
so freeing memory must not create new tensors: the storage is resized to zero bytes in place
and resized back before the next use, and every earlier view sees the new memory.

A raw view of a zero-byte storage is not safe to touch (CPU kernels read through it without
a bounds check and crash), so every access path in DBuffer goes through :meth:`check`, which
raises :class:`~dbuffer.errors.FreedBufferError` naming the tensor instead, and every tensor
handed out (the flat tensor and each :meth:`view`) is fenced while freed (:mod:`dbuffer.freed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dbuffer.errors import FreedBufferError
from dbuffer.freed import fenced_class, label


class FlatBuffer:
    """A 1-D tensor of ``numel`` elements whose storage is allocated or freed in place.

    The tensor itself is created at the first allocation (so a buffer that starts freed
    never holds its memory, not even briefly) and kept from then on.

    Args:
        numel: the number of elements.
        dtype: the element type.
        device: where the memory lives.
        what: how error messages name this buffer (e.g. ``"unsharded parameter buffer"``).
        allocated: whether memory is allocated (zero-filled) at construction or later.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, what: str, *,
                 allocated: bool, hint: str = "") -> None:
        self.what = what
        self._hint = hint
        self._numel, self._dtype, self._device = numel, dtype, device
        self._nbytes = numel * dtype.itemsize
        self._tensor: torch.Tensor | None = None
        self._storage: torch.UntypedStorage | None = None
        # An explicit state, not ``nbytes() == numel * itemsize``: a buffer of zero elements
        # (a group without tensors of its own) has zero bytes whether allocated or freed.
        self._allocated = False
        # Every tensor handed out, with its class while fenced; their own classes are taken
        # at each free and given back at re-allocation.
        self._views: list[tuple[torch.Tensor, type[torch.Tensor]]] = []
        self._classes: list[type[torch.Tensor]] = []
        # A zero-byte storage marked to throw on mutable data access: freeing swaps its data
        # pointer (and the mark) into this buffer's storage, re-allocation swaps it back.
        self._marked = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
        torch._C._set_throw_on_mutable_data_ptr(
            torch.empty(0, dtype=torch.uint8, device=device).set_(self._marked))
        if allocated:
            self._set_tensor(torch.zeros(numel, dtype=dtype, device=device))

    def _set_tensor(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self._storage = tensor.untyped_storage()
        self._allocated = True
        self.track(tensor, f"the flat {self.what}")

    @property
    def tensor(self) -> torch.Tensor:
        """The flat tensor (callers check :attr:`allocated` or call :meth:`allocate` first)."""
        if self._tensor is None:
            raise FreedBufferError(f"the {self.what} was never allocated")
        return self._tensor

    @property
    def numel(self) -> int:
        """Elements, whether the memory is allocated or not."""
        return self._numel

    @property
    def allocated(self) -> bool:
        """Whether the storage currently holds memory."""
        return self._allocated

    def allocate(self, new: Callable[[], torch.Tensor] | None = None) -> bool:
        """Restore the memory (contents undefined) if freed.

        Args:
            new: where the memory comes from (a custom collective's allocator: it returns a
                new 1-D tensor of this buffer's size that owns its memory; its memory moves
                into this buffer's storage, so every view handed out sees it). Default:
                this buffer's device allocator.

        Returns:
            True when the memory was freed (or never allocated) and is now allocated.
        """
        if self._storage is None:
            self._set_tensor(new() if new is not None else
                             torch.empty(self._numel, dtype=self._dtype, device=self._device))
            return True
        if self.allocated:
            return False
        fresh = new() if new is not None else None  # first: if it raises, nothing changed
        self._storage._swap_data_ptr_(self._marked)
        if fresh is not None:
            self._storage._swap_data_ptr_(fresh.untyped_storage())
        else:
            self._storage.resize_(self._nbytes)
        self._allocated = True
        for (view, _), cls in zip(self._views, self._classes):
            view.__class__ = cls
        return True

    def free(self) -> None:
        """Release the memory; views stay valid objects, unusable until :meth:`allocate`.

        While freed, every tensor handed out raises
        :class:`~dbuffer.errors.FreedBufferError` on use, and writes through any other
        alias of the storage raise too.
        """
        if self._storage is None or not self.allocated:
            return
        self._storage.resize_(0)
        self._storage._swap_data_ptr_(self._marked)
        self._allocated = False
        self._classes = [type(view) for view, _ in self._views]
        for view, fenced in self._views:
            view.__class__ = fenced

    def view(self, what: str, offset: int, numel: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of ``numel`` elements at ``offset``, shaped ``shape``, fenced while freed.

        Args:
            what: how errors name the view (e.g. ``"unsharded view of 'w'"``).
            offset: first element.
            numel: number of elements.
            shape: the view's shape.

        Returns:
            The view (the caller caches it; this buffer keeps it to fence it).
        """
        tensor = self.tensor.narrow(0, offset, numel).view(shape)
        self.track(tensor, what)
        return tensor

    def track(self, tensor: torch.Tensor, what: str) -> None:
        """Fence ``tensor`` (a view of this buffer, or a DTensor whose local tensor is one)
        with the views while the memory is freed.

        Args:
            tensor: the object handed out.
            what: how errors name it.
        """
        label(tensor, f"{what} is used while the {self.what} is freed; {self._hint}")
        self._views.append((tensor, fenced_class(tensor)))
        if self._storage is not None and not self._allocated:
            self._classes.append(type(tensor))
            tensor.__class__ = fenced_class(tensor)

    def check(self, name: str, hint: str) -> None:
        """Raise :class:`FreedBufferError` for tensor ``name`` if the memory is freed.

        Args:
            name: the tensor (or operation) that needed the memory.
            hint: what the caller should do first.
        """
        if not self.allocated:
            raise FreedBufferError(f"{name}: the {self.what} is freed; {hint}")

    @contextmanager
    def writing(self) -> Iterator[torch.Tensor]:
        """Write into the buffer without bumping its autograd version counter.

        Views saved for backward (unsharded parameters) are re-filled by the next all-gather
        with the same values; a version bump would make autograd reject them.
        """
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.tensor):
            yield self.tensor
