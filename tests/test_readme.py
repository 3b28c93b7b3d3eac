"""The README's headline figures say when, where and how they were measured (issue 41, item 12)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATE = re.compile(r"\b\d{1,2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) 20\d\d\b")
MACHINE = re.compile(r"\b(Intel|AMD)\b")
SOURCE = re.compile(r"\]\(((bench/RESULTS\.md|docs/[\w-]+\.md)(#[\w-]+)?)\)")


def headline_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what")]


def test_every_headline_figure_names_its_date_machine_and_the_section_holding_its_command():
    found = headline_rows()
    assert found, "the README has a headline table"
    for row in found:
        assert DATE.search(row), f"no date: {row[:80]}"
        assert MACHINE.search(row), f"no machine: {row[:80]}"
        link = SOURCE.search(row)
        assert link, f"no link to where it was measured: {row[:80]}"
        target = ROOT / link.group(2)
        assert target.exists(), link.group(1)
        if link.group(3) and target.suffix == ".md":
            anchors = {_anchor(h) for h in re.findall(r"(?m)^#+ (.+)$", target.read_text())}
            assert link.group(3)[1:] in anchors, f"no section {link.group(1)}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
