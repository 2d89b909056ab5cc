"""The architecture, enforced: an ``ast`` walk over every import in the package.

Rules (``DESIGN.md``, "Shape of the code"; docs/design.md, "Code map"):

1. ``hiradix/core`` is pure bookkeeping: it imports only the standard-library modules in
   :data:`CORE_STDLIB` and other ``hiradix.core`` modules. No torch, zmq, msgspec, numpy or
   sglang; no ``os``/``pathlib``/``mmap``/``socket``/``subprocess``-level I/O; none of the media
   (``hiradix.tiers``), data-plane (``hiradix.dataplane``), I/O-worker (``hiradix.io``),
   persistence, runtime, plugin or testing packages; and no call of the builtin ``open``.
2. Only ``hiradix/sglang_plugin`` imports sglang (in the package and in ``bench/``).

Every import counts: at module level, inside functions, under ``TYPE_CHECKING``. The checker
is tested on planted violations too, so a broken checker cannot pass silently.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What the pure core may import from the standard library: data structures, typing, time, logging,
# and pure computation (hashing and byte encoding of page contents for their content addresses).
CORE_STDLIB = frozenset({
    "__future__", "abc", "array", "bisect", "collections", "dataclasses", "enum", "functools", "hashlib",
    "heapq", "itertools", "json", "logging", "math", "operator", "struct", "time", "typing",
})  # fmt: skip
SGLANG_PACKAGE = "hiradix.sglang_plugin"


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``tree`` (relative ones resolved)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            if node.module is None or node.level:  # `from . import x` may import submodules
                out.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names)
    return out


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def check_tree(root: Path, dirs: tuple[str, ...] = ("hiradix", "bench")) -> list[Violation]:
    """Every rule broken by the Python files under ``root/<dirs>``."""
    found = []
    for top in dirs:
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(root, path)
            rel = str(path.relative_to(root))
            tree = ast.parse(path.read_text(), filename=rel)
            in_core = _in(module, "hiradix.core")
            for line, name in imports_of(tree, module, path.name == "__init__.py"):
                if _in(name, "sglang") and not _in(module, SGLANG_PACKAGE):
                    found.append(Violation(rel, line, f"imports {name} outside {SGLANG_PACKAGE}"))
                if in_core and not _in(name, "hiradix.core") and name.split(".")[0] not in CORE_STDLIB:
                    found.append(Violation(rel, line, f"hiradix.core imports {name}"))
            if in_core:
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                        found.append(Violation(rel, node.lineno, "hiradix.core calls open()"))
    return found


def test_the_package_keeps_its_layers():
    violations = check_tree(REPO)
    assert not violations, "layering broken:\n" + "\n".join(map(str, violations))


def test_core_is_there_and_walked():
    # The rules above pass vacuously if the walk finds nothing: make sure it reads the core.
    core = sorted(p.name for p in (REPO / "hiradix" / "core").glob("*.py"))
    assert {"tree.py", "ledger.py", "placement.py", "controller.py", "prefix_cache.py", "ports.py"} <= set(core)
    names = {n for p in (REPO / "hiradix" / "core").glob("*.py")
             for _, n in imports_of(ast.parse(p.read_text()), module_name(REPO, p), p.name == "__init__.py")}
    assert "hiradix.core.tree" in names and "heapq" in names


PLANTED = {
    "hiradix/core/bad_torch.py": ("import torch\n", "hiradix.core imports torch"),
    "hiradix/core/bad_io.py": ("def f():\n    import os\n    return os.getpid()\n", "hiradix.core imports os"),
    "hiradix/core/bad_media.py": ("from hiradix.tiers.nvme import NvmeStore\n", "hiradix.core imports hiradix.tiers.nvme"),
    "hiradix/core/bad_relative.py": ("from ..io import client\n", "hiradix.core imports hiradix.io"),
    "hiradix/core/bad_open.py": ("def f(p):\n    return open(p).read()\n", "hiradix.core calls open()"),
    "hiradix/core/bad_typing.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import zmq\n", "hiradix.core imports zmq"),
    "hiradix/tiers/bad_sglang.py": ("from sglang.srt.mem_cache import radix_cache\n", "imports sglang.srt.mem_cache outside"),
    "bench/bad_sglang.py": ("def f():\n    import sglang\n", "imports sglang outside"),
}  # fmt: skip


@pytest.mark.parametrize("rel", sorted(PLANTED))
def test_checker_catches_a_planted_violation(tmp_path, rel):
    for top in ("hiradix/core", "hiradix/tiers", "hiradix/sglang_plugin", "bench"):
        (tmp_path / top).mkdir(parents=True, exist_ok=True)
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "hiradix" / "__init__.py").write_text("")
    (tmp_path / "hiradix" / "core" / "fine.py").write_text("import heapq\nfrom hiradix.core import fine\n")
    (tmp_path / "hiradix" / "sglang_plugin" / "ok.py").write_text("import sglang\n")  # allowed there
    assert check_tree(tmp_path) == []
    source, expected = PLANTED[rel]
    (tmp_path / rel).write_text(source)
    violations = check_tree(tmp_path)
    assert violations and all(v.path == rel for v in violations), violations
    assert any(expected in v.what for v in violations), violations
