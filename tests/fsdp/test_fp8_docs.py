"""The ```python blocks of docs/fp8.md run: the reference here, the recipe on two gloo ranks."""

from __future__ import annotations

from tests.docs_pages import run_page_blocks


def test_fp8_page_runs(ranks) -> None:
    assert run_page_blocks("fp8.md", ranks) == 2
