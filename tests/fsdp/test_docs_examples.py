"""The ```python blocks of docs/fsdp.md run as written (distributed ones on gloo rank pools)."""

from __future__ import annotations

from tests.docs_pages import run_page_blocks


def test_fsdp_page_examples_run(ranks) -> None:
    assert run_page_blocks("fsdp.md", ranks) >= 8
