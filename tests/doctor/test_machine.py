"""``hiradix doctor`` on this machine: RAM, disk, the NVMe directory, persisted pages, the store.

| situation                                                | expected                                          |
|----------------------------------------------------------|---------------------------------------------------|
| --tp-size 8 x 64 GB DRAM; 100 / 600 / 1000 GB available  | error (fix: at most 12.5) / warning / ok, 512 GB  |
| an MLA model under TP 4                                  | DRAM and NVMe sized per node, one NVMe directory   |
| --hiradix-nvme-gb 1e9 (an exabyte)                       | disk error with the fix                           |
| the old slot files hold the space the new launch needs   | disk error saying so                              |
| --hiradix-nvme-path missing                              | error with mkdir -p                               |
| a file system that refuses O_DIRECT (injected)           | warning: buffered I/O                             |
| an index written by these flags / at another page size   | ok "re-indexes 2 pages" / warning naming page_size |
| a directory another process holds                        | error "in use"                                    |
| a store master on a closed port                          | error within the timeout                          |
| a real loopback Mooncake master                          | ok, it answered                                   |
"""

from __future__ import annotations

import fcntl
import json
import os
import time

import pytest

from hiradix.config import HiRadixConfig
from hiradix.doctor.capacity import Machine
from hiradix.doctor.nvme_dir import probe_o_direct
from hiradix.doctor.report import Status
from hiradix.doctor.store import store_check
from hiradix.testing.server import pick_free_port
from tests.doctor.helpers import doctor, persist_index
from tests.helpers.store import requires_mooncake

GB = 10**9
MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
    "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "float32", "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
}  # fmt: skip


@pytest.fixture
def nvme(tmp_path):
    path = tmp_path / "nvme"
    path.mkdir()
    return path


@pytest.fixture
def base(tiny_model, cpu_flags):
    return ["--model-path", str(tiny_model), *cpu_flags, "--enable-hiradix"]


@pytest.mark.parametrize("available_gb, status", [(100, Status.ERROR), (600, Status.WARNING), (1000, Status.OK)])
def test_dram_is_per_tp_rank(base, available_gb, status):
    found = doctor([*base, "--tp-size", "8", "--hiradix-dram-gb", "64"],
                   Machine(available_ram=lambda: available_gb * GB))
    ram = found.one("ram")
    assert ram.status is status
    assert f"--hiradix-dram-gb 64 per TP rank x 8 ranks = 512 GB of RAM on this node; {available_gb} GB available" in ram.detail
    if status is Status.ERROR:
        assert ram.fix.startswith("give at most --hiradix-dram-gb 12.5 (per copy)")
    assert found.exit_status == (1 if status is Status.ERROR else 0)


def test_an_mla_models_shared_copy_is_per_node(tmp_path, cpu_flags, nvme):
    mla = tmp_path / "mla"  # DeepSeek-V2-Lite-like (multi-head latent attention): config.json only
    mla.mkdir()
    (mla / "config.json").write_text(json.dumps(MLA_CONFIG))
    found = doctor(["--model-path", str(mla), *cpu_flags, "--enable-hiradix", "--tp-size", "4", "--hiradix-dram-gb", "2",
                    "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "1"])  # fmt: skip
    assert "--hiradix-dram-gb 2 per node (one copy shared by the 4 TP ranks" in found.one("ram").detail
    assert "= 2 GB of RAM on this node" in found.one("ram").detail
    assert "= 1 GB of disk" in found.one("disk").detail
    assert found.one("nvme-index").detail.startswith("hiradix-rank0: no directory yet")  # rank 0 owns the copy


def test_too_little_disk_is_an_error_with_the_fix(base, nvme):
    found = doctor([*base, "--hiradix-dram-gb", "0.05", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "1e9"])
    disk = found.one("disk")
    assert disk.status is Status.ERROR
    assert disk.detail.startswith("--hiradix-nvme-gb 1e+09 per TP rank x 1 rank = 1e+09 GB of disk")
    assert "give at most --hiradix-nvme-gb" in disk.fix and "the launcher refuses this" in disk.fix
    assert found.exit_status == 1


def test_an_earlier_runs_slot_files_count_as_free(base, nvme):
    """As the launcher counts them (config.check_machine): the server reuses its slot files at start."""
    held = nvme / "hiradix-rank0"
    held.mkdir(mode=0o700)
    fd = os.open(held / "nvme.kv", os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, 8 << 20)
    os.close(fd)
    args = [*base, "--hiradix-dram-gb", "0.05", "--hiradix-nvme-path", str(nvme)]
    fits = doctor([*args, "--hiradix-nvme-gb", "0.01"], Machine(disk_free=lambda path: 5 << 20)).one("disk")
    assert fits.status is not Status.ERROR, fits.detail
    assert "of which 0.008389 GB are the slot files of an earlier run" in fits.detail
    too_big = doctor([*args, "--hiradix-nvme-gb", "0.02"], Machine(disk_free=lambda path: 5 << 20)).one("disk")
    assert too_big.status is Status.ERROR and "give at most --hiradix-nvme-gb" in too_big.fix


def test_a_missing_nvme_path(base, tmp_path):
    found = doctor([*base, "--hiradix-dram-gb", "0.05", "--hiradix-nvme-path", str(tmp_path / "typo"),
                    "--hiradix-nvme-gb", "1"])  # fmt: skip
    path = found.one("nvme-path")
    assert path.status is Status.ERROR and path.fix.startswith(f"mkdir -p {tmp_path / 'typo'}")
    assert "disk" not in found.statuses() and "o_direct" not in found.statuses()


def test_o_direct(base, nvme):
    assert probe_o_direct(nvme) is None  # ext4 (and tmpfs since Linux 6.6) take it
    assert os.listdir(nvme) == []  # the probe file is gone
    found = doctor([*base, "--hiradix-dram-gb", "0.05", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.05"],
                   Machine(o_direct=lambda path: "Invalid argument"))
    o_direct = found.one("o_direct")
    assert o_direct.status is Status.WARNING
    assert "refuses O_DIRECT (Invalid argument): the server falls back to buffered I/O" in o_direct.detail
    assert found.exit_status == 0  # a warning does not fail the launch


def test_persisted_pages_are_reused_when_the_fingerprint_matches(base, nvme, tiny_model):
    persist_index(nvme, tiny_model, page_size=16, pages=2)
    found = doctor([*base, "--hiradix-dram-gb", "0.05", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.05"])
    index = found.one("nvme-index")
    assert index.status is Status.OK, index
    assert index.detail == "hiradix-rank0: the fingerprint matches these flags: the server re-indexes 2 persisted pages"


def test_another_page_size_discards_them_and_says_why(base, nvme, tiny_model):
    persist_index(nvme, tiny_model, page_size=32)
    found = doctor([*base, "--hiradix-dram-gb", "0.05", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.05"])
    index = found.one("nvme-index")
    assert index.status is Status.WARNING
    assert "written for another setup (page_size: 32 -> 16, slot_bytes: 69632 -> 36864)" in index.detail
    assert "its pages will be discarded at start" in index.detail
    assert found.exit_status == 0


def test_a_directory_another_server_holds(base, nvme, tiny_model):
    directory = persist_index(nvme, tiny_model, page_size=16)
    fd = os.open(directory / "lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running server holds it (tiers.files.lock_dir)
    try:
        found = doctor([*base, "--hiradix-dram-gb", "0.05", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.05"])
    finally:
        os.close(fd)
    held = found.one("nvme-dir")
    assert held.status is Status.ERROR and "is in use by a running server" in held.detail
    assert found.exit_status == 1


def _store_json(tmp_path, master: str) -> str:
    path = tmp_path / "store.json"
    path.write_text(json.dumps({"master_server_address": master, "rpc_timeout_ms": 500}))
    return str(path)


@requires_mooncake
def test_an_unreachable_master_is_an_error_within_the_timeout(base, tmp_path):
    master = f"127.0.0.1:{pick_free_port()}"  # nothing listens there
    store = _store_json(tmp_path, master)
    config = HiRadixConfig.from_flags(dram_gb=0.05, store="mooncake", store_config=store)
    start = time.monotonic()
    check = store_check(config, timeout_s=3.0)
    assert time.monotonic() - start < 3.0
    assert check.status is Status.ERROR and "unreachable" in check.detail
    assert check.fix.startswith(f"start the master (mooncake_master) at {master}")
    found = doctor([*base, "--hiradix-dram-gb", "0.05", "--hiradix-store", "mooncake", "--hiradix-store-config", store],
                   store_timeout_s=3.0)
    assert found.one("store").status is Status.ERROR and found.exit_status == 1


@requires_mooncake
def test_a_live_master_answers(base, tmp_path):
    from hiradix.testing.mooncake import MooncakeCluster

    with MooncakeCluster(num_holders=0, log_dir=tmp_path / "mooncake") as cluster:
        store = _store_json(tmp_path, cluster.master_address)
        found = doctor([*base, "--hiradix-dram-gb", "0.05", "--hiradix-store", "mooncake", "--hiradix-store-config",
                        store], store_timeout_s=10.0)  # fmt: skip
    line = found.one("store")
    assert line.status is Status.OK, line
    assert line.detail.startswith(f"--hiradix-store mooncake: master {cluster.master_address} answered a lookup in ")
    assert found.exit_status == 0
