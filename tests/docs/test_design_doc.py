"""docs/design.md and the reference pages beside it stay true to the code (issue 32).

* The code map of ``docs/design.md`` lists every module under ``hiradix/`` (each ``.py`` but
  ``__init__.py``, by its path relative to ``hiradix/``) once, and only modules that exist.
* Its hook table names every hook of :data:`hiradix.sglang_plugin.hooks.HOOKS`.
* The pages of :data:`PAGES` cite only tests that exist (``tests/...py::name[id]``), name only
  files of this repository that exist, only real ``--hiradix-*`` flags, and their relative links
  resolve (with ``#anchor``, to a heading of the target).

Pure: reads files, imports only the hook table and the flag table (no SGLang, no torch).
"""

from __future__ import annotations

import re
from pathlib import Path

from hiradix.config import FLAGS
from hiradix.sglang_plugin.hooks import HOOKS

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hiradix"
DESIGN = REPO / "docs" / "design.md"
PAGES = tuple(REPO / p for p in ("docs/design.md", "docs/sizing.md", "docs/cluster.md", "docs/compatibility.md",
                                 "docs/overflow-and-cold-tiers.md", "CONTRIBUTING.md"))  # fmt: skip

_BULLET = re.compile(r"^- `([^`]+\.py)`:")
_SUBPACKAGES = ("core", "dataplane", "doctor", "io", "persistence", "runtime", "sglang_plugin", "testing", "tiers")
_TOKEN = re.compile(r"`([^`]+)`")
_TEST_REF = re.compile(r"^(tests/[\w/]+\.py)?(?:::(\w+))?((?:\[[\w.-]+\])?)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FLAG = re.compile(r"--hiradix-[a-z0-9-]+")


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of ``text`` (up to the next ``## `` heading)."""
    lines = text.splitlines()
    start = lines.index(f"## {heading}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start + 1:end])


def package_modules() -> set[str]:
    """Every module of the package by its path relative to ``hiradix/`` (``core/tree.py``)."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def code_map_entries() -> list[str]:
    """The module paths the code map lists, in order (one bullet each: ``- `core/tree.py`: ...``)."""
    body = section(DESIGN.read_text(), "Code map")
    return [m.group(1) for line in body.splitlines() if (m := _BULLET.match(line))]


def test_code_map_lists_every_module_once_and_only_modules():
    listed = code_map_entries()
    assert len(listed) > 50, f"the code map's bullets were not found ({len(listed)}): the pattern is wrong"
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"docs/design.md's code map lists these modules more than once: {twice}"
    missing = sorted(package_modules() - set(listed))
    assert not missing, f"modules missing from docs/design.md's code map (add a line each): {missing}"
    gone = sorted(set(listed) - package_modules())
    assert not gone, f"docs/design.md's code map lists modules that do not exist: {gone}"


def test_hook_table_names_every_hook():
    body = section(DESIGN.read_text(), "How it plugs into SGLang 0.5.23")
    words = set(re.findall(r"\w+", body))
    absent = [spec.target for spec in HOOKS if not set(spec.target.split(".")[-2:]) <= words]
    assert not absent, f"hooks of hiradix/sglang_plugin/hooks.py missing from docs/design.md's hook table: {absent}"


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", path.read_text(), re.MULTILINE) is not None


def _repo_path(token: str) -> Path | None:
    """The file or folder of this repository a backticked token names, or None for other text.

    Repository paths (``hiradix/...``, ``tests/...``, ``scripts/...``, ...) and modules relative
    to ``hiradix/`` (``core/tree.py``) are paths; ``path.py::name`` also names what it defines."""
    word = token.split()[0] if token.split() else ""
    word = word.split("::")[0].split("[")[0].rstrip(".,;:)")
    if word.startswith(("hiradix/", "tests/", "scripts/", "bench/", "patches/", "docs/", ".ci/")):
        return REPO / word
    if word.endswith(".py") and word.split("/")[0] in _SUBPACKAGES:
        return PACKAGE / word
    return None


def cited_problems(page: Path) -> list[str]:
    """What ``page`` cites that does not exist: test files, tests, test ids, repository paths."""
    problems: list[str] = []
    last_file: Path | None = None
    for token in _TOKEN.findall(page.read_text()):
        ref = _TEST_REF.match(token)
        file_part, name, test_id = ref.groups() if ref else (None, None, "")
        if file_part is None and name is None and test_id and last_file is not None:
            name = None  # a bare `[id]`: an id of the test file cited last
        elif file_part is None and name is None:
            path = _repo_path(token)
            if path is not None and not path.exists():
                problems.append(f"`{token}`: no {path.relative_to(REPO)}")
            elif path is not None and "::" in token and path.is_file():
                attr = re.match(r"\w+", token.split("::", 1)[1])
                if attr and not _defines(path, attr.group(0)):
                    problems.append(f"`{token}`: {path.relative_to(REPO)} defines no {attr.group(0)}")
            continue
        if file_part is not None:
            last_file = REPO / file_part
            if not last_file.exists():
                problems.append(f"`{token}`: no file {file_part}")
                last_file = None
                continue
        if last_file is None:
            problems.append(f"`{token}`: a test name with no test file cited before it")
            continue
        if name and not _defines(last_file, name):
            problems.append(f"`{token}`: {last_file.relative_to(REPO)} defines no {name}")
        if test_id and f'"{test_id[1:-1]}"' not in last_file.read_text():
            problems.append(f"`{token}`: {last_file.relative_to(REPO)} has no parameter id {test_id}")
    return problems


def test_pages_cite_only_tests_and_files_that_exist():
    problems = [f"{page.relative_to(REPO)}: {p}" for page in PAGES for p in cited_problems(page)]
    assert not problems, "citations that do not resolve:\n" + "\n".join(problems)


def test_the_citation_check_catches_planted_errors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`tests/core/test_tree.py::no_such_test`, `tests/no_such_file.py`, "
                    "`tests/plugin/test_flags.py::test_refusals_name_the_flag[no-such-id]`, `core/no_such.py`, "
                    "`hiradix/config.py::no_such_name`; fine: `tests/core/test_tree.py`, `core/tree.py`")
    problems = cited_problems(page)
    assert len(problems) == 5, problems
    for bad in ("no_such_test", "no_such_file", "[no-such-id]", "core/no_such.py", "no_such_name"):
        assert any(bad in p for p in problems), (bad, problems)


def test_the_citation_check_sees_citations():
    # The check above passes vacuously if it finds nothing: make sure it reads the citations.
    compatibility = REPO / "docs" / "compatibility.md"
    tests = re.findall(r"`tests/[\w/]+\.py::\w+", compatibility.read_text())
    assert len(tests) >= 10, tests


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def test_pages_links_resolve():
    broken = []
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}: no file")
            elif anchor and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(REPO)}: {target}: no heading with anchor #{anchor}")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_pages_name_only_real_flags():
    real = {f.flag for f in FLAGS} | {"--enable-hiradix"}
    wrong = {f"{page.relative_to(REPO)}: {flag}" for page in PAGES for flag in _FLAG.findall(page.read_text())
             if flag not in real}
    assert not wrong, f"flags that do not exist: {sorted(wrong)}"
