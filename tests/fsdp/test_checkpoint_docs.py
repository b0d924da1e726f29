"""The ```python blocks of docs/fsdp-checkpoint.md run, in order, on two gloo ranks."""

from __future__ import annotations

from tests.docs_pages import python_blocks

PAGE = "fsdp-checkpoint.md"


def _run_page(blocks: list[str]) -> int:
    namespace: dict[str, object] = {"__name__": "fsdp_checkpoint_docs"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/{PAGE}[{index}]", "exec"), namespace)  # noqa: S102 - our docs
    return len(blocks)


def test_checkpoint_page_runs_on_two_ranks(ranks) -> None:
    blocks = python_blocks(PAGE)
    assert len(blocks) == 5
    assert ranks.run(2, _run_page, blocks) == [len(blocks)] * 2
