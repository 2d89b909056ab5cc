"""scripts/store_deps.py: what setup installs for the cluster store, decided from the machine.

The decision is a pure function (``plan``) fed the facts (GPU or not, ``ldconfig -p``, the
installed wheels); it is tested on facts that say "missing" and on this machine's real ones,
where setup has run and nothing must be left to do.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import store_deps  # noqa: E402

from tests.helpers.store import requires_mooncake  # noqa: E402

CPU_WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
LDCONFIG_WITH = ("1234 libs found in cache `/etc/ld.so.cache'\n"
                 "\tlibibverbs.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libibverbs.so.1\n"
                 "\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1\n")  # fmt: skip
LDCONFIG_WITHOUT = LDCONFIG_WITH.replace("\tlibibverbs.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libibverbs.so.1\n",
                                         "\tlibibverbs.so.10 (libc6,x86-64) => /opt/x/libibverbs.so.10\n")  # fmt: skip


def test_the_pins_come_from_pyproject():
    assert store_deps.pinned_requirements("store")[0] == CPU_WHEEL
    assert store_deps.pinned_requirements("store-gpu")[0] == "mooncake-transfer-engine==0.3.13.post1"


def test_libibverbs_detection_reads_ldconfig():
    assert store_deps.ldconfig_lists("libibverbs.so.1", LDCONFIG_WITH)
    assert not store_deps.ldconfig_lists("libibverbs.so.1", LDCONFIG_WITHOUT)  # .so.10 is another library
    assert not store_deps.ldconfig_lists("libibverbs.so.1", "")


def test_plan_on_a_fresh_cpu_machine_installs_the_library_and_the_non_cuda_wheel():
    steps = store_deps.plan(False, LDCONFIG_WITHOUT, {}, store_deps.pinned_requirements("store"))
    assert [cmd[:3] for _, cmd in steps] == [["apt-get", "install", "-y"], [sys.executable, "-m", "pip"]]
    assert "libibverbs1" in steps[0][1] and CPU_WHEEL in steps[1][1] and "msgpack==1.2.4" in steps[1][1]
    assert "no NVIDIA GPU" in steps[1][0]


def test_plan_replaces_the_wrong_variant_and_is_empty_when_all_is_there():
    reqs = store_deps.pinned_requirements("store-gpu")
    steps = store_deps.plan(True, LDCONFIG_WITH, {"mooncake-transfer-engine-non-cuda": "0.3.13.post1"}, reqs)
    assert [cmd[3] for _, cmd in steps] == ["uninstall", "install"]
    assert "mooncake-transfer-engine-non-cuda" in steps[0][1] and reqs[0] in steps[1][1]
    assert store_deps.plan(False, LDCONFIG_WITH, {"mooncake-transfer-engine-non-cuda": "0.3.13.post1"},
                           store_deps.pinned_requirements("store")) == []  # fmt: skip
    assert len(store_deps.plan(False, LDCONFIG_WITH, {"mooncake-transfer-engine-non-cuda": "0.3.12"},
                               store_deps.pinned_requirements("store"))) == 1  # fmt: skip


@requires_mooncake
def test_this_machine_after_setup_needs_nothing_and_store_so_links_libibverbs():
    gpu = store_deps.has_nvidia_gpu()
    facts = store_deps.ldconfig_output()
    assert store_deps.ldconfig_lists("libibverbs.so.1", facts)
    assert store_deps.plan(gpu, facts, store_deps.installed_variants(),
                           store_deps.pinned_requirements("store-gpu" if gpu else "store")) == []  # fmt: skip
    # the reason the library is needed at all: the wheel's store.so links it, TCP or not
    store_so = Path(importlib.util.find_spec("mooncake").submodule_search_locations[0]) / "store.so"
    ldd = subprocess.run(["ldd", str(store_so)], capture_output=True, text=True, timeout=60).stdout
    assert "libibverbs.so.1 =>" in ldd and "not found" not in ldd.split("libibverbs.so.1")[1].splitlines()[0]
    dry = subprocess.run([sys.executable, str(REPO / "scripts" / "store_deps.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert dry.returncode == 0 and dry.stdout == "", dry.stdout + dry.stderr
