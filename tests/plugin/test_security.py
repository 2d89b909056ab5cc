"""Security (issue 6, item 6): nothing is unpickled, and flag paths are resolved and checked.

Covered elsewhere: the DRAM pool's files are 0600 in a 0700 directory and a shared or
symlinked directory is refused (tests/tiers/test_tiers.py); the NVMe slot file is 0600 in a 0700
directory (tests/tiers/test_tiers.py); the worker's socket directory is 0700 and removed on close,
and the worker rejects undecodable messages, unknown types and out-of-range page ids or slots
without crashing (tests/io/test_io_worker.py); the same modes on a live server
(tests/benchmarks/test_soak.py, tests/plugin/test_bad_input.py).

Here: no hiradix module contains a way to unpickle (a static scan, so a future `import
pickle` fails the suite), a pickle sent to the worker is refused as malformed, and NVMe paths
given through symlinks or `..` are resolved before they are checked.
"""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import pytest

from hiradix.config import HiRadixConfig, HiRadixConfigError, check_machine
from hiradix.io.protocol import ProtocolError, StorePages, WorkerSpec, decode_request, encode

PACKAGE = Path(__file__).resolve().parents[2] / "hiradix"

# Modules whose whole purpose is (un)pickling Python objects, or that pickle what they carry.
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib",
                    "multiprocessing", "copyreg"}  # fmt: skip
# Calls that unpickle or run code: attribute or function names, whatever the receiver.
PICKLING_CALLS = {"recv_pyobj", "send_pyobj", "loads_pyobj", "unsafe_load", "full_load", "eval", "exec"}


def unpickling_sites(path: Path) -> list[str]:
    """`"<file>:<line> <what>"` for each import or call in `path` that could unpickle."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        found += [f"{path.name}:{node.lineno} import {n}" for n in names if n in PICKLING_MODULES]
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            receiver = getattr(func, "value", None)
            dotted = f"{getattr(receiver, 'id', '')}.{name}"
            if name in PICKLING_CALLS or dotted in ("torch.load", "yaml.load", "np.load", "numpy.load"):
                found.append(f"{path.name}:{node.lineno} call {dotted.lstrip('.')}")
    return found


def test_no_hiradix_module_can_unpickle():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 20  # the scan really looked at the package
    sites = [site for module in modules for site in unpickling_sites(module)]
    assert sites == []


def test_the_scan_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text(
        "import pickle\nfrom multiprocessing import Queue\nimport torch\n"
        "x = torch.load('f')\ny = sock.recv_pyobj()\nz = eval('1')\n"
    )
    assert unpickling_sites(sample) == [
        "bad.py:1 import pickle",
        "bad.py:2 import multiprocessing",
        "bad.py:4 call torch.load",
        "bad.py:5 call sock.recv_pyobj",
        "bad.py:6 call eval",
    ]


def test_a_pickle_sent_to_the_worker_is_malformed():
    job = StorePages(job_id=1, dram_pages=[0], nvme_slots=[0])
    assert decode_request(encode(job)) == job
    for payload in (pickle.dumps(job), pickle.dumps({"job_id": 1, "dram_pages": [0], "nvme_slots": [0]})):
        with pytest.raises(ProtocolError, match="malformed request"):
            decode_request(payload)
    with pytest.raises(ProtocolError):
        WorkerSpec.from_json(pickle.dumps({"dram_path": "/x"}).decode("latin-1"))


def test_nvme_path_through_symlinks_and_dotdot_is_resolved_then_checked(tmp_path, monkeypatch):
    target = tmp_path / "disk" / "hiradix"
    target.mkdir(parents=True)
    (tmp_path / "link").symlink_to(target)
    monkeypatch.chdir(tmp_path / "disk")
    for given in (tmp_path / "link", "../link", "./hiradix/../hiradix"):
        config = HiRadixConfig.from_flags(nvme_path=given, nvme_gb=0.001)
        assert config.nvme_path == target.resolve(), given
        check_machine(config)  # exists, is a writable directory, fits the disk
    # A link to nowhere is refused naming where it points (nothing gets created there).
    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "dir")
    config = HiRadixConfig.from_flags(nvme_path=tmp_path / "dangling", nvme_gb=0.001)
    with pytest.raises(HiRadixConfigError, match=f"^--hiradix-nvme-path {tmp_path / 'gone' / 'dir'} does not exist"):
        check_machine(config)
    assert not (tmp_path / "gone").exists()
    # A link to a file is refused as a file.
    (tmp_path / "file").write_text("x")
    (tmp_path / "to-file").symlink_to(tmp_path / "file")
    config = HiRadixConfig.from_flags(nvme_path=tmp_path / "to-file", nvme_gb=0.001)
    with pytest.raises(HiRadixConfigError, match="exists but is not a directory"):
        check_machine(config)
    assert os.readlink(tmp_path / "to-file") == str(tmp_path / "file")
