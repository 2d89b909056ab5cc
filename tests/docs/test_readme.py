"""The README stays a short page for users whose links, flags and defaults are true (issue 32).

* Its length: what a user reads in two minutes (the issue's bound, ~250 lines).
* Every relative link resolves to a file (and, for ``file.md#anchor``, to a heading of that file).
* Every ``--hiradix-*`` flag it names exists in :data:`hiradix.config.FLAGS`, and its table of the
  flags that matter gives each one's real default.
"""

from __future__ import annotations

import re
from pathlib import Path

from hiradix.config import FLAGS

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 250

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FLAG = re.compile(r"--hiradix-[a-z0-9-]+")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def _as_shown(value: object) -> str:
    """A default as the README's table writes it: ``4`` for 4.0, ``none`` for None."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).lower()


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_readme_links_resolve():
    broken = []
    for target in _LINK.findall(README.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path_part, _, anchor = target.partition("#")
        path = (REPO / path_part) if path_part else README
        if not path.exists():
            broken.append(f"{target}: no file {path_part}")
        elif anchor and anchor not in _anchors(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path_part}")
    assert not broken, "README.md links that do not resolve:\n" + "\n".join(broken)


def test_readme_names_only_real_flags():
    real = {f.flag for f in FLAGS} | {"--enable-hiradix"}
    named = set(_FLAG.findall(README.read_text()))
    assert named, "the README names no --hiradix-* flag: the pattern is wrong"
    assert named <= real, f"README.md names flags that do not exist: {sorted(named - real)}"


def test_readme_flag_table_defaults_are_real():
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `--hiradix-")]
    assert len(rows) >= 5, "the table of the flags that matter is missing"
    by_flag = {f.flag: f for f in FLAGS}
    wrong = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        flag = cells[0].strip("`")
        default = _as_shown(by_flag[flag].default)
        shown = cells[1].lower()
        if shown != default:
            wrong.append(f"{flag}: README says {cells[1]!r}, the code's default is {by_flag[flag].default!r}")
    assert not wrong, "\n".join(wrong)
