"""Install what the cluster store's client needs, when it is missing (run by scripts/setup).

Usage: ``.venv/bin/python scripts/store_deps.py [--dry-run]``

1. ``libibverbs.so.1``: the Mooncake wheels' ``store.so`` links it even for TCP. Missing (not
   in ``ldconfig -p``) -> ``apt-get install -y libibverbs1`` (after ``apt-get update`` if the
   first try fails).
2. The Mooncake wheel, pinned in pyproject.toml: extra ``store`` (``-non-cuda``) on a machine
   without an NVIDIA GPU, extra ``store-gpu`` (the CUDA wheel) where ``nvidia-smi -L`` lists
   one; the CUDA wheels do not import without a GPU, the non-CUDA one does not use it. A
   different variant that is installed is replaced.
3. Check: ``import mooncake.store`` in a fresh interpreter; exit 1 with its error otherwise.

Each action is printed before it runs (``[setup] ...``); ``--dry-run`` prints the plan only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13")
LIBIBVERBS = "libibverbs.so.1"


def say(message: str) -> None:
    print(f"[setup] {message}", flush=True)


def has_nvidia_gpu() -> bool:
    """True if ``nvidia-smi -L`` runs and lists a GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def ldconfig_lists(library: str, ldconfig_output: str) -> bool:
    """True if ``ldconfig -p`` output has an entry for ``library`` (e.g. ``libibverbs.so.1``)."""
    return any(line.strip().startswith(library + " ") for line in ldconfig_output.splitlines())


def ldconfig_output() -> str:
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            return subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
        except OSError:
            continue
    return ""


def pinned_requirements(extra: str, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The requirement strings of ``[project.optional-dependencies] <extra>``."""
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["optional-dependencies"][extra])


def installed_variants() -> dict[str, str]:
    """Mooncake wheel distributions installed in this interpreter: name -> version."""
    found = {}
    for name in VARIANTS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def plan(gpu: bool, ldconfig_text: str, installed: dict[str, str], requirements: list[str]) -> list[tuple[str, list[str]]]:
    """What to do, as ``(description, command)`` pairs; empty when everything is in place.

    Args:
        gpu: an NVIDIA GPU is present.
        ldconfig_text: ``ldconfig -p`` output.
        installed: :func:`installed_variants`.
        requirements: the pinned requirements of the extra that fits (wheel first).
    """
    steps: list[tuple[str, list[str]]] = []
    if not ldconfig_lists(LIBIBVERBS, ldconfig_text):
        steps.append((f"{LIBIBVERBS} is missing (Mooncake's store.so links it even for TCP): apt-get install -y "
                      "libibverbs1", ["apt-get", "install", "-y", "--no-install-recommends", "libibverbs1"]))  # fmt: skip
    wanted_name, _, wanted_version = requirements[0].partition("==")
    others = sorted(set(installed) - {wanted_name})
    if others:
        steps.append((f"removing {', '.join(others)} (the {'CUDA' if gpu else 'non-CUDA'} wheel is the one for this "
                      "machine)", [sys.executable, "-m", "pip", "uninstall", "-y", *others]))  # fmt: skip
    if installed.get(wanted_name) != wanted_version:
        why = "no NVIDIA GPU" if not gpu else "an NVIDIA GPU"
        steps.append((f"installing the Mooncake Store client {requirements[0]} ({why})",
                      [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements]))
    return steps


def run_step(description: str, command: list[str]) -> None:
    say(description)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if command[0] == "apt-get":
        if shutil.which("apt-get") is None:
            raise SystemExit(f"[setup] apt-get not found: install libibverbs1 (rdma-core) with this system's tools")
        if subprocess.run(command, env=env).returncode == 0:
            return
        say("apt-get install failed; running apt-get update, then trying again")
        subprocess.run(["apt-get", "update"], env=env, check=False)
    subprocess.run(command, env=env, check=True)


def check_import() -> None:
    proc = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"[setup] the Mooncake wheel does not import: {tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    args = parser.parse_args(argv)
    gpu = has_nvidia_gpu()
    requirements = pinned_requirements("store-gpu" if gpu else "store")
    steps = plan(gpu, ldconfig_output(), installed_variants(), requirements)
    for description, command in steps:
        if args.dry_run:
            say(f"would: {description}: {' '.join(command)}")
        else:
            run_step(description, command)
    if not args.dry_run:
        check_import()
    return 0


if __name__ == "__main__":
    sys.exit(main())
