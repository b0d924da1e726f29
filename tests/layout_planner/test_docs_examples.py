"""Every ```python block of docs/layout-planner.md runs."""

from __future__ import annotations

import pytest

from tests.docs_pages import exec_source, python_blocks

PAGE = "layout-planner.md"
BLOCKS = python_blocks(PAGE)


def test_page_has_examples() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index: int) -> None:
    exec_source(BLOCKS[index], f"{PAGE}[{index}]")
