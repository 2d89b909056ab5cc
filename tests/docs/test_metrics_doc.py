"""docs/metrics.md says what hiradix exports (issue 32; the table check moved here from
tests/runtime/test_metrics.py when the README's Metrics section moved to docs/).

* The series tables list exactly the series of ``hiradix.runtime.metrics.SERIES`` and the decode
  server's counter (``hiradix.runtime.decode_metrics``), with their type, label, label values,
  and a Meaning that starts with the series' Prometheus help text.
* The hit-details table lists the fields a response's ``cached_tokens_details`` can carry.
* Every series the page names exists; the Grafana table names the dashboard's panels.

When a test here fails after you changed a series, a field or the dashboard: update docs/metrics.md.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

from hiradix.runtime import decode_metrics
from hiradix.runtime.metrics import SERIES
from tests.docs._tables import DOCS, REPO, table, tables, unquote

DOC = DOCS / "metrics.md"
SERIES_HEADER = "| Series | Type | Label | Label values | Meaning |"
FIX = "update docs/metrics.md"


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text(encoding="utf-8")


def _expected() -> dict[str, tuple[str, str, tuple[str, ...], str]]:
    """Series name -> (type, label, label values, help) as the code exports them."""
    out = {s.name: (s.type, s.label or "-", tuple(s.values), s.help) for s in SERIES}
    out[decode_metrics.NAME] = ("counter", "outcome", tuple(decode_metrics.OUTCOMES), decode_metrics.HELP)
    return out


def test_series_tables_are_the_exported_series(text):
    rows = [row for t in tables(text, SERIES_HEADER) for row in t]
    listed = {unquote(r[0]): r for r in rows}
    expected = _expected()
    assert len(listed) == len(rows), f"a series is listed twice in docs/metrics.md: {FIX}"
    assert set(listed) == set(expected), (
        f"docs/metrics.md lists series the code does not export, or misses some ({FIX}): "
        f"{sorted(set(listed) ^ set(expected))}")
    for name, (type_, label, values, help_) in expected.items():
        _, doc_type, doc_label, doc_values, meaning = listed[name]
        assert doc_type == type_, f"{name}: type {doc_type!r} in docs/metrics.md, {type_!r} in the code ({FIX})"
        assert unquote(doc_label) == label, f"{name}: label {doc_label!r}, the code's is {label!r} ({FIX})"
        got_values = tuple(unquote(v.strip()) for v in doc_values.split(",")) if doc_values != "-" else ()
        assert got_values == values, f"{name}: label values {got_values}, the code's are {values} ({FIX})"
        assert meaning.startswith(help_), f"{name}: Meaning must start with the help text {help_!r} ({FIX})"


def test_hit_detail_fields_are_the_reported_ones(text):
    """``device`` and ``host`` are SGLang's; the others are the optional keys hiradix reports
    (``hiradix.sglang_plugin.openai_cut._OPTIONAL_KEYS``, read from the source: importing it loads SGLang)."""
    source = (REPO / "hiradix" / "sglang_plugin" / "openai_cut.py").read_text(encoding="utf-8")
    consts: dict[str, tuple] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Tuple):
            items: list[str] = []
            for elt in node.value.elts:
                if isinstance(elt, ast.Starred):
                    items += consts[elt.value.id]
                else:
                    items.append(elt.value)
            consts[node.targets[0].id] = tuple(items)
    expected = {"device", "host", *consts["_OPTIONAL_KEYS"]}
    listed = {unquote(r[0]) for r in table(text, "| Field | Tokens of the prompt whose KV ... |", "docs/metrics.md")}
    assert listed == expected, f"hit-detail fields differ from the code ({FIX}): {sorted(listed ^ expected)}"


def _sglang_series() -> set[str] | None:
    """The series names SGLang's metrics collector defines (read, not imported), or None without SGLang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "observability" / "metrics_collector.py"
    return set(re.findall(r'name="(sglang:[a-z_]+)"', path.read_text(encoding="utf-8"))) if path.exists() else None


def test_every_series_named_exists(text):
    named = set(re.findall(r"sglang:[a-z_]+", text))
    ours = {n for n in named if n.startswith("sglang:hiradix_")}
    assert ours <= set(_expected()), f"docs/metrics.md names hiradix series that do not exist ({FIX}): {ours - set(_expected())}"
    sglang = _sglang_series()
    if sglang is None:
        pytest.skip("SGLang is not installed: its series names cannot be read")
    theirs = {n.removesuffix("_total") for n in named - ours}
    known = {n.removesuffix("_total") for n in sglang}
    assert theirs and theirs <= known, f"docs/metrics.md names SGLang series that SGLang does not define: {theirs - known}"


def test_grafana_table_names_the_dashboards_panels(text):
    dashboard = json.loads((REPO / "dashboards" / "hiradix.json").read_text(encoding="utf-8"))
    expected, row = [], None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        else:
            expected.append((row, panel["title"]))
    listed = [(r[0], r[1]) for r in table(text, "| Row | Panel | Shows |", "docs/metrics.md")]
    assert listed == expected, f"docs/metrics.md's dashboard table differs from dashboards/hiradix.json ({FIX})"
