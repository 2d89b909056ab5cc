"""Apply hiradix's patches to the SGLang 0.5.23 environment of this interpreter.

Run as `.venv/bin/python patches/apply.py` (scripts/setup does). Each patch module
`pNN_*.py` in this directory has a docstring saying what it changes and why, and an
`apply()` that returns (status, detail). One line is printed per patch:
"applied", "already applied" or "skipped (<why>)". Re-running changes nothing.
A patch that cannot be applied (wrong SGLang version, a missing anchor) stops the
run with exit status 1 and a message naming the file and the anchor.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _patchlib import SKIPPED, PatchError  # noqa: E402


def patch_modules() -> list[str]:
    return sorted(p.stem for p in HERE.glob("p[0-9][0-9]_*.py"))


def main() -> int:
    for name in patch_modules():
        module = importlib.import_module(name)
        try:
            status, detail = module.apply()
        except PatchError as e:
            print(f"[patches] {module.NAME}: FAILED: {e}", file=sys.stderr)
            return 1
        if status == SKIPPED:
            print(f"[patches] {module.NAME}: skipped ({detail})")
        else:
            print(f"[patches] {module.NAME}: {status} ({detail})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
