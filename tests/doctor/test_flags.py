"""``hiradix doctor`` on the launch flags: a good launch, and each kind of bad one, in this process.

| launch                                              | expected                                             |
|-----------------------------------------------------|------------------------------------------------------|
| tiny model, DRAM + NVMe on a tmp dir                | every line ok, exit 0, nothing left behind           |
| + --enable-hierarchical-cache, --pp-size 2, a HiCache flag | one error line per flag, naming it; later checks still run |
| --hiradix-dram-gb -1                                | error naming the flag; machine checks skipped        |
| a store.json with a key StoreConfig does not have   | error naming --hiradix-store-config and the key      |
| --hiradix-nvme-dir (no such flag)                   | error: argparse's "unrecognized arguments"           |
| no --enable-hiradix                                 | error naming --enable-hiradix                        |
| a model path that does not exist                    | error "model", no traceback, no resolution           |
| a Mamba model                                       | error "model": the launcher's refusal                |
| a dense model under --attn-dp-size 2                | the launcher's refusal, naming --attn-dp-size        |
"""

from __future__ import annotations

import json
import os

import pytest

from hiradix.config import ENV_VAR
from hiradix.doctor.report import Status
from tests.doctor.helpers import doctor, doctor_main


@pytest.fixture
def launch(tiny_model, cpu_flags, tmp_path):
    """A good launch of the tiny model: 0.05 GB DRAM, 0.05 GB NVMe in a tmp dir."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    return ["--model-path", str(tiny_model), *cpu_flags, "--enable-hiradix", "--hiradix-dram-gb", "0.05",
            "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.05"]  # fmt: skip


def test_a_good_launch_is_all_ok_and_leaves_nothing_behind(launch, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    nvme = launch[launch.index("--hiradix-nvme-path") + 1]
    rc, text = doctor_main(["--", *launch])
    lines = text.splitlines()
    assert rc == 0, text
    # one line per check, every one ok; the summary last
    names = [line.split()[1] for line in lines[:-1]]
    assert names == ["sglang", "plugin", "flags", "model", "resolution", "ram", "nvme-path", "disk", "o_direct",
                     "kvikio", "nvme-index"], text
    assert all(line.startswith("ok ") for line in lines[:-1]), text
    assert lines[-1] == "hiradix doctor: 11 ok, 0 warnings, 0 errors (exit status 0)"
    assert "SGLang 0.5.23 is installed" in lines[0]
    assert "page size 16, radix cache backend hiradix, model dtype torch.float32" in text  # SGLang's resolution
    assert "--hiradix-dram-gb 0.05 per TP rank x 1 rank = 0.05 GB of RAM" in text
    assert "hiradix-rank0: no directory yet: the NVMe tier starts empty" in text
    # the checks create nothing and export nothing
    assert os.listdir(nvme) == []
    assert ENV_VAR not in os.environ


def test_each_conflicting_flag_is_its_own_error_line(launch):
    found = doctor([*launch, "--enable-hierarchical-cache", "--hicache-size", "4", "--pp-size", "2"])
    assert found.exit_status == 1
    errors = [c for c in found.checks if c.status is Status.ERROR]
    assert [(c.name, c.detail.split()[0], c.fix.split(";")[0]) for c in errors] == [
        ("conflict", "--enable-hierarchical-cache", "drop --enable-hierarchical-cache"),
        ("conflict", "--pp-size", "drop --pp-size 2"),
        ("hicache-flag", "--hicache-size", "drop --hicache-size"),
    ]
    assert "replaces SGLang's HiCache" in errors[0].detail and errors[1].detail.startswith("--pp-size 2 cannot be")
    assert "hiradix's equivalent: --hiradix-dram-gb" in errors[2].fix
    # the rest was still checked, on the flags without them
    assert found.statuses()["resolution"] is Status.OK and found.statuses()["ram"] is Status.OK


def test_a_bad_hiradix_value_names_its_flag(launch):
    found = doctor([*launch, "--hiradix-dram-gb", "-1"])  # the later one wins in argparse
    assert found.exit_status == 1
    bad = found.one("flags")
    assert bad.status is Status.ERROR and bad.detail == "--hiradix-dram-gb must be > 0, got -1"
    assert bad.fix.startswith("change --hiradix-dram-gb as the message says")
    assert "ram" not in found.statuses() and "machine checks need hiradix flags that validate" in found.note


def test_a_store_config_that_does_not_parse(launch, tmp_path):
    store = tmp_path / "store.json"
    store.write_text(json.dumps({"master_server_address": "127.0.0.1:50051", "master_port": 1}))
    found = doctor([*launch, "--hiradix-store", "mooncake", "--hiradix-store-config", str(store)])
    bad = found.one("flags")
    assert bad.status is Status.ERROR and bad.detail.startswith("--hiradix-store-config: unknown key 'master_port'")
    assert "store" not in found.statuses() and found.exit_status == 1


def test_an_unknown_flag_is_argparses_error(launch):
    found = doctor([*launch, "--hiradix-nvme-dir", "/mnt/nvme/kv"])
    flags = found.one("flags")
    assert flags.status is Status.ERROR
    assert "unrecognized arguments: --hiradix-nvme-dir /mnt/nvme/kv" in flags.detail
    assert found.exit_status == 1


def test_without_enable_hiradix(tiny_model, cpu_flags):
    found = doctor(["--model-path", str(tiny_model), *cpu_flags, "--hiradix-dram-gb", "1"])
    enable = found.one("flags")
    assert enable.status is Status.ERROR and enable.detail.startswith("--enable-hiradix is not given")
    assert enable.fix == "add --enable-hiradix"
    assert found.exit_status == 1


def test_a_model_that_is_not_there_is_an_error_line(tmp_path, cpu_flags):
    missing = tmp_path / "no-such-model"
    found = doctor(["--model-path", str(missing), *cpu_flags, "--enable-hiradix", "--hiradix-dram-gb", "0.05"])
    model = found.one("model")
    assert model.status is Status.ERROR
    assert f"--model-path {missing} is not a local directory" in model.detail
    assert "resolution" not in found.statuses()  # SGLang would go to the hub: not run
    assert found.exit_status == 1


def test_a_model_hiradix_cannot_serve(tmp_path, cpu_flags):
    mamba = tmp_path / "mamba"
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba",
                                                   "hidden_size": 64, "num_hidden_layers": 2}))
    found = doctor(["--model-path", str(mamba), *cpu_flags, "--enable-hiradix", "--hiradix-dram-gb", "0.05"])
    model = found.one("model")
    assert model.status is Status.ERROR
    assert model.detail.startswith(f"--model-path {mamba} is a Mamba/SSM/linear-attention hybrid")
    assert "resolution" not in found.statuses() and found.exit_status == 1


def test_the_launchers_own_refusals_come_through(launch):
    # a dense model with DP attention: refused by the launcher's hook (refusals.refuse_dp_attention_unless_mla)
    found = doctor([*launch, "--tp-size", "2", "--attn-dp-size", "2"])
    refusal = found.one("flags")
    assert refusal.status is Status.ERROR
    assert refusal.detail.startswith("--enable-hiradix cannot be combined with --attn-dp-size 2 for a model without MLA")
    assert refusal.fix.startswith("change --attn-dp-size")
    assert found.exit_status == 1
