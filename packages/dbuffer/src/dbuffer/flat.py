"""One flat buffer whose memory can be released and restored without replacing the tensor.

Views of a DBuffer are handed out once and kept (FSDP registers them as module parameters),
so freeing memory must not create new tensors: the storage is resized to zero bytes in place
and resized back before the next use, and every earlier view sees the new memory.

A raw view of a zero-byte storage is not safe to touch (CPU kernels read through it without
a bounds check and crash), so every access path in DBuffer goes through :meth:`check`, which
raises :class:`~dbuffer.errors.FreedBufferError` naming the tensor instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dbuffer.errors import FreedBufferError


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
                 allocated: bool) -> None:
        self.what = what
        self._numel, self._dtype, self._device = numel, dtype, device
        self._nbytes = numel * dtype.itemsize
        self._tensor: torch.Tensor | None = None
        if allocated:
            self._tensor = torch.zeros(numel, dtype=dtype, device=device)

    @property
    def tensor(self) -> torch.Tensor:
        """The flat tensor (callers check :attr:`allocated` or call :meth:`allocate` first)."""
        if self._tensor is None:
            raise FreedBufferError(f"the {self.what} was never allocated")
        return self._tensor

    @property
    def allocated(self) -> bool:
        """Whether the storage currently holds memory."""
        return (self._tensor is not None
                and self._tensor.untyped_storage().nbytes() == self._nbytes)

    def allocate(self) -> bool:
        """Restore the memory (contents undefined) if freed.

        Returns:
            True when the memory was freed (or never allocated) and is now allocated.
        """
        if self._tensor is None:
            self._tensor = torch.empty(self._numel, dtype=self._dtype, device=self._device)
            return True
        if self.allocated:
            return False
        self._tensor.untyped_storage().resize_(self._nbytes)
        return True

    def free(self) -> None:
        """Release the memory; views stay valid objects, unusable until :meth:`allocate`."""
        if self._tensor is not None:
            self._tensor.untyped_storage().resize_(0)

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
