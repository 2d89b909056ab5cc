"""Read the Markdown tables of docs/ the tests compare with the code."""

from __future__ import annotations

import html
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def cells(line: str) -> list[str]:
    """The cells of one table row, as text: ``\\|`` and HTML entities undone, whitespace trimmed."""
    parts = _CELL_SPLIT.split(line.strip())[1:-1]
    return [html.unescape(p.strip().replace("\\|", "|")) for p in parts]


def tables(text: str, header: str) -> list[list[list[str]]]:
    """Every table of ``text`` whose header row is ``header`` (cells compared, spacing ignored):
    its body rows, each a list of cells."""
    want = cells(header)
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("|") and cells(line) == want:
            rows = []
            for row in lines[i + 2:]:  # past the |---| line
                if not row.lstrip().startswith("|"):
                    break
                rows.append(cells(row))
            found.append(rows)
    return found


def table(text: str, header: str, doc: str) -> list[list[str]]:
    """The one table of ``text`` with this header (``doc`` names the file in the message)."""
    found = tables(text, header)
    assert len(found) == 1, f"{doc} must have exactly one table headed {header!r}, found {len(found)}"
    return found[0]


def unquote(cell: str) -> str:
    """A cell written as one code span (`` `x` ``), as its text."""
    return cell[1:-1] if len(cell) >= 2 and cell[0] == cell[-1] == "`" else cell
