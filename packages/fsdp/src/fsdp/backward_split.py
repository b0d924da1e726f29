"""Which trainable parameters of a group share a buffer: stages in backward order.

A group's gradients arrive over its backward, last-used parameters first (a transformer
block's MLP, then its attention). With one buffer the whole gradient buffer exists from the
first gradient to the end of the group's backward, next to all of the unsharded parameters.
Cut into two buffers by backward order, the first stage's gradients are complete while the
second stage's backward still runs: :class:`fsdp.param_group.FSDPParamGroup` reduce-scatters
that buffer then and frees its unsharded parameters and gradients, and the second stage's
gradient memory is allocated only when its first gradient arrives. At the group's peak only
one stage's gradients are unsharded.

The order of a backward is not known before it runs; the reverse of the registration order
is what modules written in forward order give (``nn.Sequential``, transformer blocks whose
attention is registered before their MLP). Vectors (norm weights, biases) are registered out
of forward order as often as not (a block's two norms next to each other), so they go to
the second stage, whose gradients come last anyway: the first stage then completes with its
last matrix. Where the guess is wrong, the first stage completes later, at worst with the
group, and nothing but its early reduction is lost.

Each stage must hold at least :data:`MIN_STAGE_BYTES`: a stage is one more all-gather and
one more reduce-scatter per step, worth it only for large buffers (so small groups keep
one buffer, and FSDP2's collective counts, unless they enclose other groups: below).

A group around other groups (the root: embedding, then the blocks, then the final norm and
the output head) is cut where its children are instead, whatever its size: the parameters
registered after its last child (the tail) are used after the children in forward, so their
gradients arrive before the children's backward and the rest's after it. With one buffer,
the whole gradient buffer would be allocated at the head's gradient and held, with the
head's unsharded weight, through every child's backward; cut there, the tail is reduced and
freed when the first child's backward starts
(:meth:`fsdp.param_group.FSDPParamGroup.reduce_before_children`), and the rest's gradient
memory is allocated at the end. That saving spans the whole backward, so it is worth one or
two more collective pairs even for a small root. The tail's vectors (the final norm) get a
buffer of their own, after its matrices (used last in forward, so their gradients come
first): a norm weight beside the head's rows would leave the head's buffer no cut into equal
whole rows (1,000 rows and a 1,024-element vector make no two equal halves), and a vector
alone is cut anywhere, as FSDP2 cuts it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

MIN_STAGE_BYTES = 4 << 20
"""The least unsharded bytes (in the parameters' own dtype) each stage must hold."""


def cut_by_children(members: Sequence[T], after_children: Callable[[T], bool]) -> bool:
    """Whether :func:`backward_stages` cuts ``members`` where the group's children are: some
    of them, not all, registered after the last child group.

    Example:
        >>> cut_by_children(["embed", "head"], lambda n: n == "head")
        True
    """
    tail = sum(1 for m in members if after_children(m))
    return 0 < tail < len(members)


def backward_stages(members: Sequence[T], nbytes: Callable[[T], int],
                    is_matrix: Callable[[T], bool], min_bytes: int = MIN_STAGE_BYTES,
                    after_children: Callable[[T], bool] | None = None) -> list[list[T]]:
    """Cut ``members`` (a group's trainable parameters of one kind, in registration order)
    into stages in backward order, each in registration order.

    When some members, but not all, are registered after the group's last child group
    (``after_children``), those come first, their matrices then their vectors (each stage
    left out when empty), and the rest last: two or three stages. Otherwise the cut is the
    point of the matrices' reverse registration order that makes the larger stage smallest (the peak holds one stage's unsharded gradients), among those leaving
    both stages at least ``min_bytes``; without such a point, one stage.

    Args:
        members: the parameters, in registration order.
        nbytes: a parameter's unsharded size in bytes.
        is_matrix: whether a parameter has two or more dims (vectors go to the second
            stage; the tail's to a stage of their own).
        min_bytes: the least bytes of each stage.
        after_children: whether a parameter is registered after the group's last child
            group (``None``: the group has none).

    Returns:
        ``[members]``, or two or three stages.

    Example:
        >>> sizes = {"wq": 4, "wo": 4, "w_up": 16, "w_down": 16, "norm": 1}
        >>> backward_stages(list(sizes), sizes.__getitem__, lambda n: n != "norm", 8)
        [['w_down'], ['wq', 'wo', 'w_up', 'norm']]
        >>> root = ["embed", "norm", "head"]
        >>> backward_stages(root, lambda n: 1, lambda n: n != "norm",
        ...                 after_children=lambda n: n != "embed")
        [['head'], ['norm'], ['embed']]
    """
    if after_children is not None and cut_by_children(members, after_children):
        tail = [m for m in members if after_children(m)]
        stages = ([m for m in tail if is_matrix(m)], [m for m in tail if not is_matrix(m)],
                  [m for m in members if not after_children(m)])
        return [stage for stage in stages if stage]
    matrices = [m for m in reversed(members) if is_matrix(m)]
    total = sum(nbytes(m) for m in members)
    best: tuple[int, int] | None = None
    first = 0
    for cut, member in enumerate(matrices[:-1], start=1):
        first += nbytes(member)
        if first < min_bytes or total - first < min_bytes:
            continue
        larger = max(first, total - first)
        if best is None or larger < best[0]:
            best = (larger, cut)
    if best is None:
        return [list(members)]
    early = {id(m) for m in matrices[:best[1]]}
    return [[m for m in members if id(m) in early], [m for m in members if id(m) not in early]]
