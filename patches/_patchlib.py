"""Helpers shared by the patches in this directory (no patch of its own).

Every patch targets the interpreter that runs it (normally `.venv/bin/python`) and
finds installed files through `importlib.metadata`, so nothing is imported that the
patch is about to fix. A patch either changes files and reports "applied", finds its
marker and reports "already applied", or decides it is not needed and reports
"skipped". Anything unexpected (wrong SGLang version, an anchor that is missing or
not unique) raises `PatchError`, which `apply.py` turns into a non-zero exit.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.23"

APPLIED = "applied"
ALREADY = "already applied"
SKIPPED = "skipped"


class PatchError(RuntimeError):
    """A patch cannot be applied safely; the message names the file and the reason."""


@dataclass(frozen=True)
class Edit:
    """Replace the unique text `anchor` in a file by `replacement`.

    `replacement` must contain the patch marker so a second run sees it.
    """

    anchor: str
    replacement: str


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def require_sglang_version() -> None:
    """Fail unless the installed SGLang is exactly the release these patches were written for."""
    found = installed_version("sglang")
    if found != SGLANG_VERSION:
        raise PatchError(
            f"these patches are written for sglang=={SGLANG_VERSION}; installed: {found or 'none'}"
        )


def installed_file(dist: str, relpath: str) -> Path:
    """Path of a file that distribution `dist` installed (the file must exist)."""
    path = Path(importlib.metadata.distribution(dist).locate_file(relpath))
    if not path.is_file():
        raise PatchError(f"{path}: file not found in the installed {dist}")
    return path


def site_packages() -> Path:
    """The site-packages directory this interpreter installs pure-Python packages into."""
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` in one rename, keeping the file mode."""
    mode = path.stat().st_mode if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def edit_file(path: Path, marker: str, edits: list[Edit]) -> str:
    """Apply `edits` to `path` once; return APPLIED or ALREADY.

    The file counts as patched when it contains `marker`. Otherwise every anchor
    must occur exactly once; if one does not, nothing is written and PatchError
    names the file and the anchor.
    """
    text = path.read_text(encoding="utf-8")
    if marker in text:
        return ALREADY
    check_anchors(path, marker, edits)
    for edit in edits:
        text = text.replace(edit.anchor, edit.replacement, 1)
    write_atomic(path, text)
    return APPLIED


def edit_files(targets: list[tuple[Path, list[Edit]]], marker: str) -> tuple[str, str]:
    """Apply one patch that edits several files: every anchor of every file is checked before
    anything is written (a failure leaves no half-patched state). Returns ``(status, paths)``:
    APPLIED if any file changed, else ALREADY, and the files as one comma-separated string."""
    for path, edits in targets:
        check_anchors(path, marker, edits)
    statuses = [edit_file(path, marker, edits) for path, edits in targets]
    return (APPLIED if APPLIED in statuses else ALREADY), ", ".join(str(p) for p, _ in targets)


def check_anchors(path: Path, marker: str, edits: list[Edit]) -> None:
    """Raise PatchError unless `path` is patched already or holds every anchor exactly once."""
    text = path.read_text(encoding="utf-8")
    if marker in text:
        return
    for edit in edits:
        if marker not in edit.replacement:
            raise PatchError(f"{path}: replacement text lacks the marker {marker!r} (bug in the patch)")
        count = text.count(edit.anchor)
        if count != 1:
            what = "missing" if count == 0 else f"found {count} times, expected once"
            raise PatchError(f"{path}: anchor {what}:\n---\n{edit.anchor}\n---")


def python_ok(code: str, timeout_s: float = 120.0) -> tuple[bool, str]:
    """Run `code` in a fresh interpreter (this one); return (exit status 0, last output line)."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, (lines[-1] if lines else "")
