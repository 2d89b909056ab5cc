"""Is the install right: the pinned SGLang, and hiradix registered as its plugin.

Read from the installed distributions' metadata (``importlib.metadata``); SGLang is not imported.
The pin is hiradix's own requirement (``pyproject.toml``: ``sglang==0.5.23``).
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

from hiradix.doctor.report import Check, error, ok, warning

PLUGIN_GROUP = "sglang.srt.plugins"  # SGLang's entry-point group of general plugins
PLUGIN_NAME = "hiradix"
PLUGIN_TARGET = "hiradix.sglang_plugin.plugin:register"
SETUP_FIX = "run scripts/setup (it installs the pinned SGLang and hiradix, editable)"
_PIN = re.compile(r"^sglang\s*==\s*([^;\s]+)")


def pinned_sglang() -> str | None:
    """The SGLang version hiradix pins: its installed requirement, else ``pyproject.toml`` next to
    the package (a source tree that was never installed); None when neither says."""
    try:
        requires = metadata.requires("hiradix") or []
    except metadata.PackageNotFoundError:
        requires = []
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not requires and pyproject.is_file():
        import tomllib

        requires = tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", [])
    for line in requires:
        found = _PIN.match(line.strip())
        if found:
            return found.group(1)
    return None


def sglang_check() -> Check:
    """SGLang is installed at the version hiradix pins (its hooks target that release's internals)."""
    pinned = pinned_sglang()
    want = f"sglang=={pinned}" if pinned else "the pinned sglang"
    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return error("sglang", "SGLang is not installed", f"install {want}; {SETUP_FIX}")
    if pinned is None:
        return warning("sglang", f"SGLang {installed} is installed; hiradix's pin could not be read",
                       f"reinstall hiradix ({SETUP_FIX})")
    if installed != pinned:
        return error("sglang", f"SGLang {installed} is installed, hiradix is built for {pinned} (its hooks "
                     "wrap private scheduler methods of that release)", f"install {want}; {SETUP_FIX}")
    return ok("sglang", f"SGLang {installed} is installed, the version hiradix pins")


def plugin_check() -> Check:
    """The ``sglang.srt.plugins`` entry point ``hiradix`` resolves to this package's ``register``,
    and nothing stops SGLang from loading it (``SGLANG_PLUGINS``, a shadowing folder)."""
    found = [ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not found:
        return error("plugin", f"no {PLUGIN_GROUP!r} entry point named {PLUGIN_NAME!r}: SGLang would start "
                     "without hiradix and refuse --enable-hiradix as an unknown flag", f"install hiradix; {SETUP_FIX}")
    if len({ep.value for ep in found}) > 1:
        return warning("plugin", f"{len(found)} installs register {PLUGIN_NAME!r}: "
                       f"{', '.join(sorted({ep.value for ep in found}))}", "uninstall the old ones (pip uninstall hiradix)")
    try:
        register = found[0].load()
    except Exception as exc:  # noqa: BLE001 - SGLang, too, only logs "Failed to load plugin hiradix" and starts stock
        return error("plugin", f"the entry point {found[0].value} does not import: {type(exc).__name__}: {exc}",
                     f"reinstall hiradix; {SETUP_FIX}")
    from hiradix.sglang_plugin import hooks

    shadowed = hooks.package_problem()
    if shadowed:
        return error("plugin", shadowed, "run from another directory")
    allowed = [p.strip() for p in os.environ.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if allowed and PLUGIN_NAME not in allowed:
        return error("plugin", f"SGLANG_PLUGINS={os.environ['SGLANG_PLUGINS']} leaves hiradix out: SGLang would not "
                     "load it", f"add {PLUGIN_NAME} to SGLANG_PLUGINS or unset it")
    where = f"{register.__module__}:{register.__name__}"
    return ok("plugin", f"entry point {PLUGIN_GROUP}:{PLUGIN_NAME} -> {where} resolves")
