"""docs/configuration.md says what the code accepts (issue 32; the flag-table check moved here from
tests/plugin/test_flags.py when the README's flag table moved to docs/).

* Flags: the table and the `hiradix` group of `--help` (built by the plugin's own
  ``after_add_cli_args``) list the same flags, each row with the flag's help text word for word
  and its default as `--help` shows it; the Required column agrees with the validation.
* ``store.json``: the documented keys are the fields of ``StoreConfig``, which its parser accepts
  (no more, no fewer), with their defaults; a file built from the documented defaults parses.
* Environment variables: every ``HIRADIX_*`` name the package, scripts/, .ci/ and tests/conftest.py
  mention is documented, and every one documented exists.
* The HiCache table names exactly the HiCache flags hiradix refuses.

When a test here fails after you changed a flag, a store key or a variable: update docs/configuration.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

from hiradix.config import FLAGS, HiRadixConfig, HiRadixConfigError
from hiradix.core.store_tier import STORE_RETRY_MAX_S, STORE_RETRY_S
from hiradix.sglang_plugin import flags
from hiradix.sglang_plugin.refusals import HICACHE_EQUIVALENTS
from hiradix.tiers.store.base import StoreConfig
from tests.docs._tables import DOCS, REPO, table, unquote

DOC = DOCS / "configuration.md"
FLAG_HEADER = "| Flag | Default | Required | Notes |"
KEY_HEADER = "| Key | Default | Required | Notes |"
WHEN = " **When to change:** "  # what may follow the help text in a Notes cell
FIX = "update docs/configuration.md"
# The flags another flag makes required, and the values that require them.
REQUIRED_WITH = {"--hiradix-nvme-path": ("--hiradix-nvme-gb", dict(nvme_gb=1)),
                 "--hiradix-store-config": ("--hiradix-store", dict(store="mooncake"))}
ENV_NAME = re.compile(r"\bHIRADIX_[A-Z0-9_]+\b")


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text(encoding="utf-8")


def _help_group() -> dict[str, tuple[str, str]]:
    """Flag -> (help text, default) of the `hiradix` group of `--help`."""
    parser = argparse.ArgumentParser()
    flags.after_add_cli_args(None, parser)
    (group,) = [g for g in parser._action_groups if g.title == "hiradix"]
    out = {}
    for action in group._group_actions:
        shown = re.fullmatch(r"(.*) Default: (.+)\.", action.help, re.S)
        if shown:
            out[action.option_strings[0]] = (shown.group(1), shown.group(2))
        else:  # no default shown: a switch (off) or a value flag without a default
            out[action.option_strings[0]] = (action.help, "off" if action.nargs == 0 else "none")
    return out


def test_flag_table_is_the_help_text(text):
    rows = table(text, FLAG_HEADER, "docs/configuration.md")
    listed = {unquote(r[0]): r for r in rows}
    expected = _help_group()
    assert len(expected) == len(FLAGS) + 1  # --enable-hiradix and every FlagSpec
    assert len(listed) == len(rows), f"a flag is listed twice ({FIX})"
    assert set(listed) == set(expected), (
        f"the flag table and --help differ ({FIX}): only in the doc {sorted(set(listed) - set(expected))}, "
        f"only in --help {sorted(set(expected) - set(listed))}")
    for flag, (help_text, default) in expected.items():
        _, doc_default, _, notes = listed[flag]
        assert unquote(doc_default) == default, f"{flag}: default {doc_default!r} in the doc, {default!r} in --help ({FIX})"
        assert notes == help_text or notes.startswith(help_text + WHEN), (
            f"{flag}: Notes must be the --help text word for word, optionally followed by {WHEN.strip()!r} ({FIX}); "
            f"--help says {help_text!r}")


def test_required_column_agrees_with_the_validation(text):
    required = {unquote(r[0]): r[2] for r in table(text, FLAG_HEADER, "docs/configuration.md")}
    assert required.pop("--enable-hiradix") == "yes"
    for flag, (trigger, values) in REQUIRED_WITH.items():
        cell = required.pop(flag)
        assert cell.startswith("with ") and trigger in cell, f"{flag}: Required should say 'with {trigger}', got {cell!r}"
        with pytest.raises(HiRadixConfigError) as refused:  # the trigger without the flag is refused, naming it
            HiRadixConfig.from_flags(**values)
        assert flag in str(refused.value)
    assert set(required.values()) == {"no"}, f"every other flag is optional: {required}"


def test_store_json_keys_are_what_the_parser_accepts(text):
    rows = table(text, KEY_HEADER, "docs/configuration.md")
    listed = {unquote(r[0]): r for r in rows}
    fields = {f.name: f for f in dataclasses.fields(StoreConfig)}
    assert set(listed) == set(fields), (
        f"documented store.json keys differ from StoreConfig's ({FIX}): {sorted(set(listed) ^ set(fields))}")
    documented = {}
    for name, f in fields.items():
        _, default, required, _ = listed[name]
        has_default = f.default is not dataclasses.MISSING
        assert required == ("no" if has_default else "yes"), f"store.json {name}: Required is {required!r} ({FIX})"
        if has_default:
            assert unquote(default) == json.dumps(f.default), f"store.json {name}: default {default!r}, code {f.default!r}"
            documented[name] = json.loads(unquote(default))
        else:
            assert default == "none", f"store.json {name} has no default; the doc says {default!r}"
    # every documented key with its documented default is accepted by the parser itself
    config = StoreConfig.parse(json.dumps({**documented, "master_server_address": "10.0.0.1:50051"}), "--x")
    assert config == StoreConfig(master_server_address="10.0.0.1:50051")
    with pytest.raises(ValueError, match="unknown key 'no_such_key'"):  # and only those keys
        StoreConfig.parse('{"master_server_address": "h:1", "no_such_key": 1}', "--x")


def test_store_json_example_parses(text):
    section = text.split("## `store.json` keys", 1)[1]
    example = re.search(r"```json\n(.*?)```", section, re.S).group(1)
    assert StoreConfig.parse(example, "--hiradix-store-config").protocol == "rdma"


def _env_section(text: str) -> str:
    return text.split("## Environment variables", 1)[1]


def _names_in(*paths: str) -> dict[str, str]:
    """HIRADIX_* name -> the first file (relative) that mentions it, over these files and folders."""
    out: dict[str, str] = {}
    for rel in paths:
        base = REPO / rel
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file() and p.suffix in ("", ".py", ".sh"))
        for path in files:
            try:
                source = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for name in ENV_NAME.findall(source):
                out.setdefault(name, path.relative_to(REPO).as_posix())
    return out


def test_every_env_var_the_code_reads_is_documented(text):
    documented = set(ENV_NAME.findall(_env_section(text)))
    used = _names_in("hiradix", "scripts", ".ci", "tests/conftest.py")
    assert "HIRADIX_STORE_RETRY_S" in used and "HIRADIX_LOG_LEVEL" in used  # the walk sees the package
    missing = {name: where for name, where in used.items() if name not in documented}
    assert not missing, f"document these in docs/configuration.md, 'Environment variables': {missing}"


def test_every_documented_env_var_exists(text):
    documented = set(ENV_NAME.findall(_env_section(text)))
    anywhere = _names_in("hiradix", "scripts", ".ci", "tests", "patches", "pyproject.toml")
    assert documented <= set(anywhere), f"docs/configuration.md documents variables nothing reads: {documented - set(anywhere)}"


def test_operator_variables_and_their_defaults(text):
    rows = {unquote(r[0]): r for r in table(text, "| Variable | Default | Meaning |", "docs/configuration.md")}
    assert {"HIRADIX_LOG_LEVEL", "HIRADIX_STORE_RETRY_S"} <= set(rows), "the user-facing variables belong in 'For operators'"
    _, default, meaning = rows["HIRADIX_STORE_RETRY_S"]
    assert unquote(default) == f"{STORE_RETRY_S:g}" and f"{STORE_RETRY_MAX_S:g} s" in meaning, (
        f"HIRADIX_STORE_RETRY_S: the code waits {STORE_RETRY_S:g} s, doubling up to {STORE_RETRY_MAX_S:g} s ({FIX})")


def test_hicache_table_is_the_refused_hicache_flags(text):
    listed = [unquote(r[0]) for r in table(text, "| HiCache flag | hiradix equivalent |", "docs/configuration.md")]
    refused = ["--" + field.replace("_", "-") for field in HICACHE_EQUIVALENTS]  # as refusals.given_hicache_flag spells them
    assert sorted(listed) == sorted(refused), f"HiCache flags: doc and refusals.HICACHE_EQUIVALENTS differ ({FIX})"


def test_what_enable_hiradix_turns_on(text):
    part = text.split("### What `--enable-hiradix` changes in SGLang's settings", 1)[1].split("\n### ", 1)[0]
    for _, flag in flags.REQUIRED_SGLANG_FLAGS:
        assert f"`{flag}`" in part, f"{flag}: --enable-hiradix turns it on; say so ({FIX})"
    assert f"`--page-size` defaults to {flags.DEFAULT_PAGE_SIZE_TOKENS}" in part
    assert f"`--radix-cache-backend {flags.BACKEND_NAME}`" in part
