"""The planner's output: where every tensor lives in one flat buffer of ``world_size * S``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from layout_planner.spec import TensorSpec


@dataclass(frozen=True)
class PlanEntry:
    """One tensor's place in the flat buffer.

    Args:
        name: The tensor's name.
        offset: First element of the tensor in the global flat buffer.
        numel: Number of elements.
        unit: Atomic block in elements (boundaries cut only at multiples of it).
        shape: The tensor's shape, if it was given.
    """

    name: str
    offset: int
    numel: int
    unit: int
    shape: tuple[int, ...] | None

    @property
    def end(self) -> int:
        """One past the tensor's last element in the global flat buffer."""
        return self.offset + self.numel

    def spec(self) -> TensorSpec:
        """The :class:`TensorSpec` this entry places."""
        return TensorSpec(self.name, self.numel, self.unit, self.shape)


@dataclass(frozen=True)
class Plan:
    """A layout of one FSDP group: rank ``r`` owns the flat range ``[r*S, (r+1)*S)``.

    Construction checks the plan (so a plan read from JSON is as trustworthy as a computed
    one): entries disjoint and in offset order, inside ``world_size * S``, offsets and ``S``
    multiples of ``align``, and every rank boundary inside a tensor on one of its unit
    boundaries.

    Args:
        world_size: Number of ranks.
        shard_size: ``S``, elements per rank.
        entries: The tensors in buffer order.
        align: Alignment in elements of every offset and of ``S``.

    Raises:
        ValueError: When the layout breaks one of the rules above, naming the tensor.
    """

    world_size: int
    shard_size: int
    entries: tuple[PlanEntry, ...]
    align: int = 1
    _index: dict[str, PlanEntry] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))
        _check_plan(self)
        object.__setattr__(self, "_index", {e.name: e for e in self.entries})

    @property
    def numel(self) -> int:
        """Total elements of all tensors (the buffer without padding)."""
        return sum(e.numel for e in self.entries)

    @property
    def padding(self) -> int:
        """Elements of the buffer that hold no tensor: ``world_size * S - numel``."""
        return self.world_size * self.shard_size - self.numel

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the tensors' elements (0.077 means 7.7% more memory)."""
        total = self.numel
        return self.padding / total if total else 0.0

    def entry(self, name: str) -> PlanEntry:
        """The entry of tensor ``name``.

        Args:
            name: A tensor name in this plan.

        Returns:
            Its :class:`PlanEntry`.

        Raises:
            KeyError: When no tensor of that name is in the plan.
        """
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in this plan") from None

    def local_range(self, name: str, rank: int) -> tuple[int, int]:
        """The part of tensor ``name`` that ``rank`` holds.

        Args:
            name: A tensor name in this plan.
            rank: A rank in ``[0, world_size)``.

        Returns:
            ``(start, end)`` relative to the tensor's first element; ``(0, 0)`` if the rank
            holds none of it.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is out of range for world_size {self.world_size}")
        e = self.entry(name)
        start = max(e.offset, rank * self.shard_size)
        end = min(e.end, (rank + 1) * self.shard_size)
        if start >= end:
            return (0, 0)
        return (start - e.offset, end - e.offset)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of the plan (see :meth:`to_json`)."""
        return {
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "align": self.align,
            "entries": [
                {
                    "name": e.name,
                    "offset": e.offset,
                    "numel": e.numel,
                    "unit": e.unit,
                    "shape": None if e.shape is None else list(e.shape),
                }
                for e in self.entries
            ],
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal plans give equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json`; the plan is checked again on the way in.

        Args:
            text: The JSON string.

        Returns:
            The plan.

        Raises:
            ValueError: On malformed JSON or an invalid layout.
        """
        try:
            data = json.loads(text)
            entries = tuple(
                PlanEntry(
                    name=d["name"],
                    offset=d["offset"],
                    numel=d["numel"],
                    unit=d["unit"],
                    shape=None if d["shape"] is None else tuple(d["shape"]),
                )
                for d in data["entries"]
            )
            return cls(data["world_size"], data["shard_size"], entries, data["align"])
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a plan JSON: {exc}") from exc

    def fingerprint(self) -> str:
        """A stable hash of the plan (SHA-256 of the canonical JSON), equal on every rank."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def _check_plan(p: Plan) -> None:
    for name, value, low in (("world_size", p.world_size, 1), ("shard_size", p.shard_size, 0), ("align", p.align, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"plan {name} must be an int >= {low}, got {value!r}")
    if p.shard_size % p.align:
        raise ValueError(f"shard size {p.shard_size} is not a multiple of align {p.align}")
    total = p.world_size * p.shard_size
    cursor = 0
    seen: set[str] = set()
    for e in p.entries:
        if not isinstance(e, PlanEntry):
            raise ValueError(f"plan entries must be PlanEntry, got {type(e).__name__}")
        e.spec()  # validates name, sizes and shape
        if e.name in seen:
            raise ValueError(f"tensor {e.name!r} appears twice in the plan")
        seen.add(e.name)
        if isinstance(e.offset, bool) or not isinstance(e.offset, int) or e.offset < cursor:
            raise ValueError(f"tensor {e.name!r}: offset {e.offset!r} overlaps the previous tensor or is not an int")
        if e.offset % p.align:
            raise ValueError(f"tensor {e.name!r}: offset {e.offset} is not a multiple of align {p.align}")
        if e.end > total:
            raise ValueError(f"tensor {e.name!r} ends at {e.end}, past the buffer of {total} elements")
        if p.shard_size:
            boundary = (e.offset // p.shard_size + 1) * p.shard_size
            while boundary < e.end:
                if (boundary - e.offset) % e.unit:
                    raise ValueError(
                        f"tensor {e.name!r}: rank boundary {boundary} cuts it {boundary - e.offset} elements in, "
                        f"not a multiple of its unit {e.unit}"
                    )
                if p.shard_size % e.unit == 0:
                    break  # every later boundary is a whole number of shards further: also on a unit boundary
                boundary += p.shard_size
        cursor = e.end
