"""The ```python blocks of docs/block-optim/adamw8bit.md run as written (distributed ones on a
2-rank gloo pool)."""

from __future__ import annotations

from tests.block_optim.test_muon_docs import run_page


def test_adamw8bit_page_examples_run(ranks) -> None:
    run_page("adamw8bit.md", ranks)
