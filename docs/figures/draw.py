"""Draw the concept figures of the manual (docs/img/concepts/*.png) from real objects.

Every figure is computed, not sketched: the RaggedShard figure reads the ranges from a
``RaggedShard`` placement, the plan and DBuffer figures draw what ``layout_planner.plan``
returns for a small group, the optimizer figures plan with each optimizer's own
``unit_policy``, and Muon's owner exchange uses ``layout_planner.assign_owners`` as the
optimizer does. Rerun after changing a concept page's example:

    hatch run python docs/figures/draw.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

import torch  # noqa: E402
from block_optim import AdamW8bit, Muon, Shampoo  # noqa: E402
from layout_planner import Plan, TensorSpec, assign_owners, plan  # noqa: E402
from ragged_dtensor import RaggedShard  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "img" / "concepts"
RANK_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")
TENSOR_COLOURS = ("#8172B3", "#64B5CD", "#CCB974", "#937860")
PAD = "#DDDDDD"

#: The small group every plan-based figure draws (and concepts.md plans the same way).
GROUP = (
    TensorSpec("attn.wq", 24, unit=4, shape=(6, 4)),
    TensorSpec("norm", 5, unit=1, shape=(5,)),
    TensorSpec("mlp.w", 32, unit=8, shape=(4, 8)),
    TensorSpec("bias", 3, unit=1, shape=(3,)),
)
WORLD = 3


def _cell_row(ax: Axes, y: float, colours: list[str], *, height: float = 0.8,
              x0: float = 0.0, labels: list[str] | None = None) -> None:
    """One row of unit-width cells at height ``y`` (padding cells hatched)."""
    for i, colour in enumerate(colours):
        hatch = "//" if colour == PAD else None
        ax.add_patch(Rectangle((x0 + i, y), 1, height, facecolor=colour, edgecolor="white",
                               linewidth=0.6, hatch=hatch))
        if labels and labels[i]:
            ax.text(x0 + i + 0.5, y + height / 2, labels[i], ha="center", va="center",
                    fontsize=7, color="white")


def _finish(ax: Axes, fig: plt.Figure, name: str, width: float, height: float,
            bottom: float = -1.2) -> None:
    ax.set_xlim(-0.5, width)
    ax.set_ylim(bottom, height)
    ax.axis("off")
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / name, dpi=130, bbox_inches="tight")
    plt.close(fig)


def ragged_shard() -> None:
    """A ``[8, 3]`` weight under ``RaggedShard((0,), (3, 0, 4, 1))``: rows by owner, then flat."""
    shape, placement = (8, 3), RaggedShard(dims=(0,), local_units=(3, 0, 4, 1))
    counts = placement.local_units
    row_len = shape[1]
    owner = [r for r, c in enumerate(counts) for _ in range(c)]  # one unit = one row here
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for row in range(shape[0]):
        _cell_row(ax, shape[0] - 1 - row, [RANK_COLOURS[owner[row]]] * row_len, height=0.9)
        ax.text(-0.3, shape[0] - 1 - row + 0.45, f"row {row}", ha="right", va="center", fontsize=8)
    ax.text(1.5, shape[0] + 0.3, "tensor [8, 3]: one unit = one row", ha="center", fontsize=9)
    flat = [RANK_COLOURS[owner[i // row_len]] for i in range(shape[0] * row_len)]
    _cell_row(ax, 2.0, flat, x0=6.0, height=0.9)
    ax.text(6.0, 3.2, "row-major flat order: each rank holds one contiguous run of whole units",
            fontsize=9)
    start = 0
    for rank, c in enumerate(counts):
        n = c * row_len
        label = f"rank {rank}\n[{start}, {start + n})" + ("\n0 units" if n == 0 else "")
        ax.text(6.0 + start + n / 2, 1.6, label, ha="center", va="top", fontsize=8,
                color=RANK_COLOURS[rank])
        start += n
    _finish(ax, fig, "ragged-shard.png", 31, 9)


def _plan_colours(p: Plan) -> tuple[list[str], list[str]]:
    """Per-element fill colour and unit-start labels of ``p``'s buffer."""
    colours = [PAD] * (p.world_size * p.shard_size)
    labels = [""] * len(colours)
    for i, e in enumerate(p.entries):
        for k in range(e.numel):
            colours[e.offset + k] = TENSOR_COLOURS[i % len(TENSOR_COLOURS)]
        for k in range(0, e.numel, e.unit):
            labels[e.offset + k] = "|"
    return colours, labels


def _rank_boundaries(ax: Axes, p: Plan, y0: float, y1: float) -> None:
    for r in range(p.world_size + 1):
        x = r * p.shard_size
        ax.plot([x, x], [y0, y1], color="black", linewidth=2)
    for r in range(p.world_size):
        ax.text((r + 0.5) * p.shard_size, y1 + 0.1, f"rank {r}", ha="center", va="bottom",
                fontsize=9, color=RANK_COLOURS[r], fontweight="bold")


def plan_figure(p: Plan) -> None:
    """The plan's buffer: tensors, unit starts, rank boundaries on unit boundaries, padding."""
    fig, ax = plt.subplots(figsize=(12, 2.0))
    colours, _ = _plan_colours(p)
    _cell_row(ax, 0, colours, height=1.0)
    for e in p.entries:
        for k in range(e.unit, e.numel, e.unit):
            ax.plot([e.offset + k] * 2, [0, 1], color="black", linewidth=0.6)
        ax.text(e.offset + e.numel / 2, -0.35, f"{e.name} {e.shape}\nunit {e.unit}",
                ha="center", va="top", fontsize=8)
    _rank_boundaries(ax, p, -0.1, 1.1)
    ax.text(0, 2.1, f"plan(GROUP, world_size={p.world_size}): shard_size S={p.shard_size}, "
            f"padding {p.padding} of {p.world_size * p.shard_size} (hatched); thin lines: unit "
            "boundaries, thick: rank boundaries", fontsize=9)
    _finish(ax, fig, "plan.png", p.world_size * p.shard_size + 0.5, 2.6)


def dbuffer_figure(p: Plan) -> None:
    """Parameters and gradients as views of flat buffers, and the two in-place collectives."""
    fig, ax = plt.subplots(figsize=(12, 5.0))
    colours, _ = _plan_colours(p)
    s = p.shard_size
    right = p.world_size * (s + 1.5) + 1

    def per_rank(y: float, what: str) -> None:
        for r in range(p.world_size):
            x0 = r * (s + 1.5)
            _cell_row(ax, y, colours[r * s:(r + 1) * s], x0=x0, height=0.8)
            ax.add_patch(Rectangle((x0, y), s, 0.8, fill=False, edgecolor=RANK_COLOURS[r],
                                   linewidth=2))
            ax.text(x0, y + 0.95, f"rank {r}: {what} [{r * s}, {(r + 1) * s})", fontsize=8,
                    color=RANK_COLOURS[r])

    def arrow(y_from: float, y_to: float, text: str) -> None:
        ax.add_patch(FancyArrowPatch((right, y_from), (right, y_to), arrowstyle="-|>",
                                     mutation_scale=15, color="black"))
        ax.text(right + 1, (y_from + y_to) / 2, text, va="center", fontsize=8)

    per_rank(7.2, "sharded parameters")
    _cell_row(ax, 4.8, colours, height=0.8)
    ax.text(0, 5.75, "unsharded parameter buffer: each parameter is a view at its plan offset",
            fontsize=9)
    _cell_row(ax, 2.4, colours, height=0.8)
    ax.text(0, 3.35, "unsharded gradient buffer: autograd accumulates .grad views in place",
            fontsize=9)
    per_rank(0.0, "sharded gradients")
    arrow(7.1, 5.7, "all_gather, in place:\nno copy-in / copy-out")
    arrow(4.7, 3.3, "forward + backward")
    arrow(2.3, 0.9, "reduce_scatter reads\nthe buffer directly")
    ax.text(0, -0.7, "sharded_param(name) / sharded_grad(name): RaggedShard DTensors over the "
            "rank's slice; hatched: padding from the plan", fontsize=8)
    _finish(ax, fig, "dbuffer.png", right + 16, 8.4)


def muon_figure() -> None:
    """Muon on 2 ranks: a matrix cut by the rank boundary goes whole to its owner and back."""
    matrices = {"A": (4, 6), "B": (6, 6), "C": (3, 6)}  # rows x cols
    unit = Muon.unit_policy()  # one row of a 2-D matrix
    specs = [TensorSpec(n, r * c, unit=unit(n, torch.empty(r, c)), shape=(r, c))
             for n, (r, c) in matrices.items()]
    p = plan(specs, 2)
    whole = {}
    for i, e in enumerate(p.entries):
        holders = [r for r in range(2) if p.local_range(e.name, r) != (0, 0)]
        if len(holders) == 1:
            whole[i] = holders[0]
    costs = [5 * (4 * r * r * c + 2 * r ** 3) for r, c in matrices.values()]
    owners = assign_owners(costs, 2, fixed=whole)
    fig, ax = plt.subplots(figsize=(12, 4.0))
    colours, _ = _plan_colours(p)
    _cell_row(ax, 3.0, colours, height=0.8)
    _rank_boundaries(ax, p, 2.95, 3.85)
    for i, e in enumerate(p.entries):
        centre = e.offset + e.numel / 2
        ax.text(centre, 2.75, e.name, ha="center", va="top", fontsize=9)
        cut = i not in whole
        owner = owners[i]
        height = e.shape[0] * 0.2
        ax.add_patch(Rectangle((centre - e.shape[1] / 2, 0.4), e.shape[1], height,
                               facecolor=TENSOR_COLOURS[i], edgecolor=RANK_COLOURS[owner],
                               linewidth=2.5))
        what = ("cut by a rank boundary:\none all_to_all to its owner,\nNewton-Schulz, one back"
                if cut else "whole on one rank:\npinned there, no traffic")
        ax.text(centre, 0.25, f"{e.name} {e.shape}: owner rank {owner}\n{what}", fontsize=8,
                ha="center", va="top", color=RANK_COLOURS[owner])
        ax.add_patch(FancyArrowPatch((centre, 2.35), (centre, 0.5 + height),
                                     arrowstyle="<|-|>" if cut else "-|>", mutation_scale=12,
                                     color="black" if cut else "grey",
                                     linestyle="-" if cut else ":"))
    ax.text(0, 4.5, "Muon: momentum is updated elementwise on local shards; each matrix's "
            "Newton-Schulz runs once, on its owner (assign_owners)", fontsize=9)
    _finish(ax, fig, "muon.png", p.world_size * p.shard_size + 1, 4.8, bottom=-1.8)


def shampoo_figure() -> None:
    """Shampoo: a 12 x 8 matrix with max_preconditioner_dim=4, planned on 3 ranks."""
    rows, cols, dim = 12, 8, 4
    unit = Shampoo.unit_policy(max_preconditioner_dim=dim)("w", torch.empty(rows, cols))
    p = plan([TensorSpec("w", rows * cols, unit=unit, shape=(rows, cols))], 3)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for row in range(rows):
        start = row * cols
        rank = next(r for r in range(3) if p.local_range("w", r)[0] <= start < p.local_range("w", r)[1])
        _cell_row(ax, rows - 1 - row, [RANK_COLOURS[rank]] * cols, height=0.9)
        if row % dim == 0:
            ax.text(cols + 0.6, rows - row - dim / 2,
                    f"band {row // dim} on rank {rank}: two {dim}x{dim} blocks, each with its own\n"
                    f"L ({dim}x{dim}) and R ({dim}x{dim}), preconditioned where it lies",
                    va="center", fontsize=8, color=RANK_COLOURS[rank])
    for b in range(rows // dim + 1):
        ax.plot([-0.2, cols + 0.2], [b * dim - 0.05] * 2, color="black", linewidth=2)
    ax.plot([dim - 0.02] * 2, [-0.05, rows - 0.05], color="black", linewidth=1)
    ax.text(0, rows + 0.5, f"Shampoo(max_preconditioner_dim={dim}): Shampoo.unit_policy gives the "
            "planner one band of rows", fontsize=9)
    _finish(ax, fig, "shampoo.png", cols + 22, rows + 1.2)


def adamw8bit_figure() -> None:
    """AdamW8bit: blocks of 256 elements (drawn as 8 cells), one absmax scale per block."""
    blocks, cells = 7, 8
    unit = AdamW8bit.unit_policy(min_8bit_numel=1024)("w", torch.empty(blocks * 256))
    p = plan([TensorSpec("w", blocks * unit, unit=unit)], 3)
    fig, ax = plt.subplots(figsize=(11, 2.4))
    for b in range(blocks):
        rank = next(r for r in range(3) if p.local_range("w", r)[0] <= b * 256 < p.local_range("w", r)[1])
        _cell_row(ax, 0, [RANK_COLOURS[rank]] * cells, x0=b * (cells + 0.5), height=0.9)
        ax.text(b * (cells + 0.5) + cells / 2, -0.3, f"block {b}:\n2 x 256 int8 codes\n+ 2 fp32 absmax",
                ha="center", va="top", fontsize=7)
    counts = [p.local_range("w", r)[1] - p.local_range("w", r)[0] for r in range(3)]
    ax.text(0, 1.4, f"AdamW8bit: rank cuts between 256-element blocks (per-rank elements "
            f"{counts}): each rank quantizes its own blocks, no communication", fontsize=9)
    _finish(ax, fig, "adamw8bit.png", blocks * (cells + 0.5), 2.0)


def main() -> None:
    """Draw every figure into docs/img/concepts/."""
    group_plan = plan(GROUP, WORLD)
    ragged_shard()
    plan_figure(group_plan)
    dbuffer_figure(group_plan)
    muon_figure()
    shampoo_figure()
    adamw8bit_figure()


if __name__ == "__main__":
    main()
