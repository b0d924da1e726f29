"""The ```python blocks of the Shampoo page run as written (distributed ones on 2 ranks)."""

from __future__ import annotations

from tests.block_optim.test_muon_docs import run_page


def test_page_examples_run(ranks) -> None:
    run_page("shampoo.md", ranks)
