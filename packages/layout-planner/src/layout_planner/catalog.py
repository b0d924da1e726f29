"""A small catalog of public model shapes (shipped as ``data/models.json``).

Each model is a list of FSDP groups (embedding, one transformer layer, head) with a count of
identical copies, so a whole model is planned by planning each distinct group once. Shapes
follow the Hugging Face parameter names and layouts of each model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from layout_planner.spec import TensorSpec
from layout_planner.units import UnitRule


@dataclass(frozen=True)
class Group:
    """One FSDP group of a model and how many identical copies the model has.

    Args:
        name: Group name (``embed``, ``layer``, ``moe_layer``, ``head``).
        count: Number of identical copies in the model.
        kind: ``embedding``, ``layer`` or ``head``.
        tensors: ``(name, shape)`` of every tensor, in module order.
    """

    name: str
    count: int
    kind: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]

    def specs(self, rule: UnitRule) -> list[TensorSpec]:
        """The group's tensors as specs, with units from ``rule``.

        Args:
            rule: How units follow from shapes.

        Returns:
            One :class:`TensorSpec` per tensor, in module order.
        """
        return [TensorSpec(n, math.prod(s), rule.unit_for(s), s) for n, s in self.tensors]


@dataclass(frozen=True)
class Model:
    """A catalog model.

    Args:
        name: Catalog key, e.g. ``llama3-70b``.
        description: One line about the model.
        groups: Its FSDP groups.
    """

    name: str
    description: str
    groups: tuple[Group, ...]

    @property
    def numel(self) -> int:
        """Parameters of the whole model."""
        return sum(g.count * sum(math.prod(s) for _, s in g.tensors) for g in self.groups)


def _expand(items: list) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = []
    for item in items:
        if isinstance(item, dict):
            body = _expand(item["tensors"])
            out.extend((name.replace("{i}", str(i)), shape) for i in range(item["repeat"]) for name, shape in body)
        else:
            out.append((item[0], tuple(item[1])))
    return out


@lru_cache(maxsize=1)
def catalog() -> dict[str, Model]:
    """Every catalog model by name (read once from the package data).

    Returns:
        ``{name: Model}`` in catalog order.
    """
    raw = json.loads(resources.files("layout_planner").joinpath("data/models.json").read_text())
    return {
        name: Model(
            name,
            entry["description"],
            tuple(Group(g["name"], g["count"], g["kind"], tuple(_expand(g["tensors"]))) for g in entry["groups"]),
        )
        for name, entry in raw.items()
    }


def get_model(name: str) -> Model:
    """One catalog model.

    Args:
        name: Catalog key.

    Returns:
        The model.

    Raises:
        ValueError: On an unknown name (the message lists the known ones).
    """
    models = catalog()
    if name not in models:
        raise ValueError(f"unknown model {name!r}; the catalog has {', '.join(models)}")
    return models[name]
