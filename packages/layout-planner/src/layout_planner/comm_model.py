"""An alpha-beta model of ring collectives on a cluster of multi-GPU nodes.

A ring of ``m`` ranks runs an all-gather or a reduce-scatter of ``S`` elements per rank in
``m - 1`` steps; in each step every rank sends one ``S``-element chunk to its neighbour, so a
step costs a latency ``alpha`` plus ``chunk_bytes / beta``. An all-reduce is a reduce-scatter
followed by an all-gather: ``2 (m - 1)`` steps of ``1/m`` of the buffer.

When the ring spans nodes, the model is hierarchical in the way NCCL's own tuning model is
(``src/graph/tuning.cc``): of the ``m - 1`` steps, ``n - 1`` cross a node boundary (``n``
nodes) and pay the inter-node latency, the rest pay the intra-node one; the bandwidth term
runs at the speed of the slowest hop, the inter-node link, since every step waits for all
hops. Ranks are numbered node-major (``rank // gpus_per_node`` is the node), as
``torchrun`` and ``DeviceMesh`` lay them out, so a group of ``k`` ranks ``stride`` apart
spans ``k`` nodes when ``stride >= gpus_per_node`` and ``(k - 1) * stride // gpus_per_node + 1``
otherwise.

Everything here is arithmetic on plain numbers: pure Python, no dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


def _positive_number(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        low = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {low}, got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Link:
    """The cost of one ring step over one kind of link: ``latency + chunk_bytes / bandwidth``.

    Args:
        bandwidth: Bytes per second one GPU sends over the link in one direction while every
            other GPU of the ring does the same (a bus bandwidth, as ``nccl-tests`` reports it).
        latency: Seconds of fixed cost per ring step (``alpha``), whatever the chunk size.

    Raises:
        ValueError: When ``bandwidth`` is not positive or ``latency`` is negative.
    """

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        _positive_number("link bandwidth", self.bandwidth)
        _positive_number("link latency", self.latency, allow_zero=True)

    def step_time(self, chunk_bytes: float) -> float:
        """Seconds for one ring step that moves ``chunk_bytes`` per rank.

        Args:
            chunk_bytes: Bytes each rank sends in the step.

        Returns:
            ``latency + chunk_bytes / bandwidth``.
        """
        return self.latency + chunk_bytes / self.bandwidth


# Assumed defaults, not measurements: H100 SXM nodes of 8 GPUs. NVLink 4 moves 900 GB/s per
# GPU in both directions together, 450 GB/s each way; one 400 Gb/s NIC per GPU (a DGX H100 has
# eight ConnectX-7) moves 50 GB/s each way. Latencies per ring step are NCCL's own Ring/Simple
# figures from its tuning model (src/graph/tuning.cc: 3.4 us over NVLink, 9.6 us over the
# network). Measured bus bandwidths are lower than these peaks; pass your cluster's own.
NVLINK4 = Link(bandwidth=450e9, latency=3.4e-6)
NIC_400G = Link(bandwidth=50e9, latency=9.6e-6)


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs joined by ``intra`` links inside a node and ``inter`` across.

    The defaults describe 8-GPU NVLink 4 nodes with one 400 Gb/s NIC per GPU (see
    ``NVLINK4`` and ``NIC_400G`` in this module for where the numbers come from: they are
    assumptions, to be replaced by measured bus bandwidths).

    Args:
        gpus_per_node: GPUs in one node.
        intra: The link between GPUs of one node.
        inter: The link between nodes, per GPU.

    Raises:
        ValueError: When ``gpus_per_node`` is not a positive int or a link is not a :class:`Link`.
    """

    gpus_per_node: int = 8
    intra: Link = field(default=NVLINK4)
    inter: Link = field(default=NIC_400G)

    def __post_init__(self) -> None:
        _positive_int("gpus_per_node", self.gpus_per_node)
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"cluster {name} must be a Link, got {getattr(self, name)!r}")

    def nodes_spanned(self, ranks: int, stride: int = 1) -> int:
        """Nodes a group of ``ranks`` ranks ``stride`` apart touches (node-major numbering).

        Args:
            ranks: Ranks in the group.
            stride: Distance between consecutive members (1 for an FSDP shard group, the shard
                group size for an HSDP replicate group).

        Returns:
            The number of distinct nodes.
        """
        _positive_int("ranks", ranks)
        _positive_int("stride", stride)
        if stride >= self.gpus_per_node:
            return ranks
        return (ranks - 1) * stride // self.gpus_per_node + 1

    def ring_time(self, ranks: int, steps_per_rank: int, chunk_bytes: float, stride: int = 1) -> float:
        """Seconds for ``steps_per_rank * (ranks - 1)`` ring steps of ``chunk_bytes`` each.

        ``steps_per_rank * (nodes - 1)`` of the steps cross a node boundary and pay the
        inter-node latency; all steps move their chunk at the slowest link's bandwidth.

        Args:
            ranks: Ranks in the ring.
            steps_per_rank: 1 for all-gather and reduce-scatter, 2 for all-reduce.
            chunk_bytes: Bytes each rank sends per step.
            stride: Distance between consecutive members of the group.

        Returns:
            The time in seconds (0 for a single rank).
        """
        nodes = self.nodes_spanned(ranks, stride)
        steps = steps_per_rank * (ranks - 1)
        inter_steps = steps_per_rank * (nodes - 1)
        bandwidth = self.intra.bandwidth if nodes == 1 else min(self.intra.bandwidth, self.inter.bandwidth)
        latency = (steps - inter_steps) * self.intra.latency + inter_steps * self.inter.latency
        return latency + steps * chunk_bytes / bandwidth


def all_gather_time(cluster: Cluster, ranks: int, shard_bytes: float, stride: int = 1) -> float:
    """Seconds for a ring all-gather in which every rank contributes ``shard_bytes``.

    On one node this is ``(ranks - 1) * (alpha + shard_bytes / beta)``.

    Args:
        cluster: The cluster.
        ranks: Ranks in the group.
        shard_bytes: Bytes of one rank's shard (``S`` times the element size).
        stride: Distance between consecutive members of the group.

    Returns:
        The time in seconds.
    """
    return cluster.ring_time(ranks, 1, shard_bytes, stride)


def reduce_scatter_time(cluster: Cluster, ranks: int, shard_bytes: float, stride: int = 1) -> float:
    """Seconds for a ring reduce-scatter whose output is ``shard_bytes`` per rank.

    The same steps as :func:`all_gather_time`, run in the other direction (the reduction's
    arithmetic is not modelled).

    Args:
        cluster: The cluster.
        ranks: Ranks in the group.
        shard_bytes: Bytes of one rank's output shard.
        stride: Distance between consecutive members of the group.

    Returns:
        The time in seconds.
    """
    return cluster.ring_time(ranks, 1, shard_bytes, stride)


def all_reduce_time(cluster: Cluster, ranks: int, nbytes: float, stride: int = 1) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` on every rank.

    A reduce-scatter then an all-gather of ``nbytes / ranks`` chunks: on one node
    ``2 (ranks - 1) * (alpha + nbytes / (ranks * beta))``.

    Args:
        cluster: The cluster.
        ranks: Ranks in the group.
        nbytes: Bytes of the buffer every rank holds.
        stride: Distance between consecutive members of the group.

    Returns:
        The time in seconds.
    """
    return cluster.ring_time(ranks, 2, nbytes / ranks, stride)


def fit_link(samples: Iterable[tuple[int, float, float]]) -> Link:
    """Fit a :class:`Link` to measured single-node ring times by least squares.

    Each sample is ``(ranks, chunk_bytes, seconds)`` and the model is
    ``seconds = (ranks - 1) * (alpha + chunk_bytes / beta)``, linear in ``alpha`` and
    ``1 / beta``. Residuals are taken relative to the measured time, so a 20 us collective
    counts as much as a 20 ms one (plain least squares would let the largest messages decide
    ``alpha`` alone). Data that follow the model exactly are recovered exactly.

    Args:
        samples: At least two samples with different ``chunk_bytes``; ``ranks >= 2``,
            ``chunk_bytes >= 0`` and ``seconds > 0``.

    Returns:
        The fitted link (``latency`` = alpha, ``bandwidth`` = beta).

    Raises:
        ValueError: On too few or invalid samples, or when the fit gives a non-positive
            bandwidth or a negative latency (the data do not follow the model's form).
    """
    rows = []
    for ranks, chunk_bytes, seconds in samples:
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
            raise ValueError(f"sample ranks must be an int >= 2, got {ranks!r}")
        _positive_number("sample chunk_bytes", chunk_bytes, allow_zero=True)
        _positive_number("sample seconds", seconds)
        steps = ranks - 1
        rows.append((steps / seconds, steps * chunk_bytes / seconds))  # each row divided by its target
    # Normal equations of min sum (a*x0 + b*x1 - 1)^2 with x = (alpha, 1/beta).
    s00 = sum(x0 * x0 for x0, _ in rows)
    s01 = sum(x0 * x1 for x0, x1 in rows)
    s11 = sum(x1 * x1 for _, x1 in rows)
    t0 = sum(x0 for x0, _ in rows)
    t1 = sum(x1 for _, x1 in rows)
    det = s00 * s11 - s01 * s01
    if len(rows) < 2 or det <= 1e-12 * s00 * s11:
        raise ValueError("fit_link needs at least two samples with different chunk sizes")
    alpha = (t0 * s11 - t1 * s01) / det
    inverse_beta = (s00 * t1 - s01 * t0) / det
    if inverse_beta <= 0 or alpha < 0:
        raise ValueError(
            f"the samples do not follow the alpha-beta form: fitted alpha={alpha:.3g} s, "
            f"1/beta={inverse_beta:.3g} s/byte"
        )
    return Link(bandwidth=1.0 / inverse_beta, latency=alpha)
