"""The ```python blocks of docs/fsdp-tp.md run as written (the recipe on 4 gloo ranks)."""

from __future__ import annotations

from tests.docs_pages import run_page_blocks


def test_fsdp_tp_page_examples_run(ranks) -> None:
    assert run_page_blocks("fsdp-tp.md", ranks) >= 1
