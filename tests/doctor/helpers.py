"""Helpers of the doctor tests: run it in-process, find a check's line, persist an NVMe index."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hiradix.dataplane.layout import KVLayout
from hiradix.doctor.capacity import Machine
from hiradix.doctor.cli import main, run_checks
from hiradix.doctor.report import Check, Status, exit_status
from hiradix.persistence.fingerprint import (
    kv_fingerprint,
    model_identity,
    weights_stamp,
)
from hiradix.persistence.index import NvmeIndex
from hiradix.tiers.files import ensure_private_dir
from hiradix.tiers.nvme import NVME_FILE_NAME, slot_bytes_for


@dataclass
class Outcome:
    """One doctor run: its checks, exit status and the note of its summary line."""

    checks: list[Check]
    exit_status: int
    note: str

    def named(self, name: str) -> list[Check]:
        return [c for c in self.checks if c.name == name]

    def one(self, name: str) -> Check:
        found = self.named(name)
        assert len(found) == 1, f"{name}: {found}\n" + self.text()
        return found[0]

    def statuses(self) -> dict[str, Status]:
        return {c.name: c.status for c in self.checks}

    def text(self) -> str:
        return "\n".join(c.line() for c in self.checks)


def doctor(flags: list[str], machine: Machine | None = None, store_timeout_s: float | None = None) -> Outcome:
    """Run every check of the launch ``flags`` in this process."""
    checks, note, _ = run_checks(flags, machine, store_timeout_s)
    return Outcome(checks, exit_status(checks), note)


def doctor_main(argv: list[str], machine: Machine | None = None) -> tuple[int, str]:
    """``hiradix doctor <argv>`` in this process: (exit status, what it printed)."""
    out = io.StringIO()
    return main(argv, out=out, machine=machine), out.getvalue()


def tiny_layout(model: Path, page_size: int) -> KVLayout:
    """The KV layout of ``model`` under TP 1 and ``--dtype float32``, from its config.json."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return KVLayout(num_layers=config["num_hidden_layers"], page_size=page_size,
                    num_kv_heads=config["num_key_value_heads"], head_dim=head_dim, dtype=torch.float32)  # fmt: skip


def persist_index(nvme: Path, model: Path, page_size: int, pages: int = 1) -> Path:
    """Make ``nvme/hiradix-rank0`` as a TP-1 server of ``model`` (float32) at ``page_size`` leaves it:
    an index (the real :class:`NvmeIndex`) listing ``pages`` pages of one prefix, and a slot file."""
    layout = tiny_layout(model, page_size)
    fingerprint = kv_fingerprint(model_identity(str(model)), "torch.float32", layout, 0, 1,
                                 slot_bytes_for(layout.page_bytes), weights_stamp=weights_stamp(str(model)))
    directory, _ = ensure_private_dir(nvme / "hiradix-rank0")
    index, _ = NvmeIndex.open(directory, fingerprint, num_slots=16, page_tokens=page_size)
    index.record(list(range(pages)), b"", [list(range(i * page_size, (i + 1) * page_size)) for i in range(pages)], None)
    index.close()
    (directory / NVME_FILE_NAME).write_bytes(b"")
    return directory
