"""The manual's own pages (getting started, concepts, multi-node) run as written, and the site's
navigation lists every page exactly once and nothing that does not exist.

Distributed recipes run on the shared gloo rank pools (see ``tests.docs_pages``); the nav
check reads ``mkdocs.yml`` so a page added without a nav entry (which ``mkdocs build
--strict`` only reports as an info line) fails here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from layout_planner import plan

from tests.docs_pages import DOCS, python_blocks, run_page_blocks

MKDOCS = DOCS.parent / "mkdocs.yml"
MANUAL_PAGES = ("concepts.md", "multi-node.md")


def nav_pages(node: Any) -> Iterator[str]:
    """Every page path named in a mkdocs ``nav`` tree (external links skipped)."""
    if isinstance(node, str):
        if "://" not in node:
            yield node
    elif isinstance(node, list):
        for item in node:
            yield from nav_pages(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from nav_pages(value)


@pytest.mark.parametrize("page", MANUAL_PAGES)
def test_manual_page_examples_run(page: str, ranks) -> None:
    assert run_page_blocks(page, ranks) > 0


def test_getting_started_quotes_the_readme_commands() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    page = (DOCS / "getting-started.md").read_text()
    for command in ("pip install hatch && hatch run train", "pip install hatch && hatch run test"):
        assert command in readme and command in page, command
    assert not python_blocks("getting-started.md")


def test_concept_figures_exist() -> None:
    text = (DOCS / "concepts.md").read_text()
    for name in ("ragged-shard", "plan", "dbuffer", "muon", "shampoo", "adamw8bit"):
        assert f"](img/concepts/{name}.png)" in text, name
        assert (DOCS / "img" / "concepts" / f"{name}.png").stat().st_size > 0, name


def test_figure_script_draws_every_figure_from_the_pages_plan(tmp_path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("draw", DOCS / "figures" / "draw.py")
    draw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw)
    monkeypatch.setattr(draw, "OUT", tmp_path)
    draw.main()
    committed = sorted(p.name for p in (DOCS / "img" / "concepts").glob("*.png"))
    assert sorted(p.name for p in tmp_path.glob("*.png")) == committed
    # The plan figure and DBuffer figure draw the plan the concepts page computes.
    namespace: dict[str, Any] = {}
    exec(next(b for b in python_blocks("concepts.md") if "group = [" in b), namespace)  # noqa: S102
    assert namespace["p"] == plan(draw.GROUP, draw.WORLD)


def test_nav_lists_every_page_once_and_only_existing_pages() -> None:
    nav = list(nav_pages(yaml.safe_load(MKDOCS.read_text())["nav"]))
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert sorted(set(nav) - on_disk) == [], "nav entries without a page"
    assert sorted(on_disk - set(nav)) == [], "pages missing from the nav"
    assert len(nav) == len(set(nav)), "a page is listed twice"


PACKAGES = ("layout_planner", "ragged_dtensor", "dbuffer", "block_optim", "fsdp")


def test_every_public_name_has_an_api_entry() -> None:
    """Each name in a package's ``__all__`` has a ``::: package.name`` entry in the docs, or,
    when re-exported from another of our packages, an entry there; torch's own classes that
    fsdp re-exports (``MixedPrecisionPolicy`` ...) are documented by torch."""
    import importlib

    text = "\n".join(page.read_text() for page in DOCS.rglob("*.md"))
    missing = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            home = getattr(getattr(module, name), "__module__", package).split(".")[0]
            if home == "torch":
                continue
            if f"::: {package}.{name}" not in text and f"::: {home}.{name}" not in text:
                missing.append(f"{package}.{name}")
    assert not missing, f"public names without an API entry in docs/: {missing}"
