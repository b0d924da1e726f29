"""The ```python blocks of docs/fsdp-migration.md run, in order, on two gloo ranks."""

from __future__ import annotations

from tests.docs_pages import python_blocks

PAGE = "fsdp-migration.md"


def _run_page(blocks: list[str]) -> int:
    namespace: dict[str, object] = {"__name__": "fsdp_migration_docs"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/{PAGE}[{index}]", "exec"), namespace)  # noqa: S102 - our docs
    return len(blocks)


def test_migration_page_runs_on_two_ranks(ranks) -> None:
    blocks = python_blocks(PAGE)
    assert len(blocks) == 4
    assert ranks.run(2, _run_page, blocks) == [len(blocks)] * 2
