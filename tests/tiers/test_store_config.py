"""StoreConfig (``--hiradix-store-config``), the object framing and the env a client gets.

No Mooncake process is needed: these run without the wheel.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hiradix.tiers.store import StoreConfig, StoreConfigError
from hiradix.tiers.store.framing import check_keys, key_id, pack_object_trailer, verify_object
from hiradix.tiers.store.mooncake import mooncake_env

FLAG = "--hiradix-store-config"
MINIMAL = '{"master_server_address": "10.0.0.7:50051"}'


def test_minimal_json_gets_the_documented_defaults():
    config = StoreConfig.parse(MINIMAL, FLAG)
    assert config.master_host_port == ("10.0.0.7", 50051)
    assert (config.protocol, config.metadata_server, config.global_segment_bytes) == ("tcp", "P2PHANDSHAKE", 0)
    assert config.rpc_timeout_ms == 1000 and config.rpc_timeout_s == 1.0
    assert StoreConfig.parse(config.to_json(), FLAG) == config


def test_the_wedged_call_limit_is_derived_from_the_deadlines_unless_given():
    from hiradix.io.worker import _derived_call_limit_s

    derived = SimpleNamespace(config=StoreConfig.parse(MINIMAL, FLAG))  # 1 s RPC + a 6 s stall (2 s transfer, lanes)
    assert derived.config.call_limit_s == 0 and derived.config.stall_s == 6.0 and _derived_call_limit_s(derived) == 28.0
    slow = SimpleNamespace(config=StoreConfig.parse('{"master_server_address": "h:1", "transfer_timeout_s": 30}', FLAG))
    assert _derived_call_limit_s(slow) == 4 * (62.0 + 1.0)
    unpooled = SimpleNamespace(config=StoreConfig.parse('{"master_server_address": "h:1", "tcp_connection_pool": false}',
                                                        FLAG))  # fmt: skip
    assert unpooled.config.stall_s == 2.0 and _derived_call_limit_s(unpooled) == 12.0
    given = SimpleNamespace(config=StoreConfig.parse('{"master_server_address": "h:1", "call_limit_s": 90}', FLAG))
    assert _derived_call_limit_s(given) == 90.0


def test_a_json_file_path_is_read(tmp_path):
    path = tmp_path / "store.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:9", "protocol": "rdma", "device_name": "mlx5_0",
                                "rpc_timeout_ms": 250, "local_hostname": "10.1.2.3"}))  # fmt: skip
    config = StoreConfig.parse(str(path), FLAG)
    assert (config.protocol, config.device_name, config.rpc_timeout_ms) == ("rdma", "mlx5_0", 250)


@pytest.mark.parametrize(
    "text, key_or_words",
    [
        ('{"master_server_address": "nohost"}', "master_server_address"),
        ('{"master_server_address": "h:70000"}', "master_server_address"),
        ('{"master_server_address": "h:1", "protocol": "udp"}', "protocol"),
        ('{"master_server_address": "h:1", "rpc_timeout_ms": 0}', "rpc_timeout_ms"),
        ('{"master_server_address": "h:1", "rpc_timeout_ms": 1.5}', "rpc_timeout_ms"),
        ('{"master_server_address": "h:1", "rpc_timeout_ms": 100.0}', "rpc_timeout_ms"),
        ('{"master_server_address": "h:1", "transfer_timeout_s": 0}', "transfer_timeout_s"),
        ('{"master_server_address": "h:1", "setup_retries": true}', "setup_retries"),
        ('{"master_server_address": "h:1", "tcp_connection_pool": 1}', "tcp_connection_pool"),
        ('{"master_server_address": "h:1", "tcp_lanes_per_peer": 17}', "tcp_lanes_per_peer must be in 1..16"),
        ('{"master_server_address": "h:1", "tcp_lanes_per_peer": 0}', "tcp_lanes_per_peer"),
        ('{"master_server_address": "h:1", "call_limit_s": -1}', "call_limit_s"),
        ('{"master_server_address": "h:1", "call_limit_s": 3601}', "call_limit_s"),
        ('{"master_server_address": "h:1", "global_segment_bytes": -1}', "global_segment_bytes"),
        ('{"master_server_address": "h:1", "local_buffer_bytes": "16MB"}', "local_buffer_bytes"),
        ('{"master_server_address": "h:1", "local_hostname": " "}', "local_hostname"),
        ('{"master_server_address": "h:1", "segment": 5}', "'segment'"),
        ('{"protocol": "tcp"}', "missing key 'master_server_address'"),
        ('{"master_server_address": ', "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ("/nonexistent/store.json", "cannot read /nonexistent/store.json"),
        ("", "must not be empty"),
    ],
)
def test_bad_config_names_the_flag_and_the_key(text, key_or_words):
    with pytest.raises(StoreConfigError) as err:
        StoreConfig.parse(text, FLAG)
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith(FLAG) and key_or_words in str(err.value), str(err.value)


def test_client_env_sets_the_deadlines_and_loopback_binding():
    env = mooncake_env(StoreConfig.parse('{"master_server_address": "127.0.0.1:5", "rpc_timeout_ms": 300, '
                                         '"transfer_timeout_s": 3, "setup_retries": 2}', FLAG))  # fmt: skip
    assert env == {"MC_RPC_TIMEOUT_MS": "300", "MC_STORE_CLIENT_SETUP_RETRIES": "2", "MC_TCP_PROGRESS_TIMEOUT_SEC": "3",
                   "MC_TCP_STATUS_TIMEOUT_SEC": "3", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
                   "MC_TCP_ENABLE_CONNECTION_POOL": "1", "MC_TCP_LANES_PER_PEER": "16"}  # fmt: skip
    unpooled = StoreConfig.parse('{"master_server_address": "h:1", "tcp_connection_pool": false, '
                                 '"tcp_lanes_per_peer": 4}', FLAG)  # fmt: skip
    assert mooncake_env(unpooled)["MC_TCP_ENABLE_CONNECTION_POOL"] == "0"
    assert (unpooled.keys_per_call, StoreConfig("h:1").keys_per_call, StoreConfig("h:1", tcp_lanes_per_peer=4).keys_per_call) == (512, 16, 4)
    named = mooncake_env(StoreConfig("h:1", local_hostname="node7.cluster"))
    assert "MC_TCP_BIND_ADDRESS" not in named  # a DNS name: Mooncake resolves it
    assert mooncake_env(StoreConfig("h:1", local_hostname="localhost"))["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"


def test_object_framing_rejects_another_keys_object_and_any_flipped_byte():
    payload = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    trailer = np.frombuffer(pack_object_trailer(payload, "a"), dtype=np.uint8)
    assert verify_object(payload, trailer, "a") is None
    assert verify_object(payload, trailer, "b") == "object of another key"
    assert key_id("a") != key_id("b")
    for index in (0, 2047, 4095):
        bad = payload.copy()
        bad[index] ^= 1
        assert verify_object(bad, trailer, "a") == "checksum mismatch"
    assert "payload length" in verify_object(payload[:-8], trailer, "a")
    assert "trailer length" in verify_object(payload, trailer[:-1], "a")
    assert "bad magic" in verify_object(payload, np.zeros_like(trailer), "a")


def test_keys_are_checked():
    check_keys(["a", "k" * 256], 2)
    for keys, pages in ((["a"], 2), ([""], 1), (["k" * 257], 1), ([3], 1)):
        with pytest.raises(ValueError):
            check_keys(keys, pages)


def test_a_lookup_does_not_wait_for_a_transfer_running_on_another_thread():
    """Issue 31: PUTs and GETs take the client's lock (the staging buffer); a lookup, a master RPC,
    runs beside them, and the wedge watchdog still sees the longest call (the blocked transfer)."""
    import threading

    from hiradix.tiers.store.mooncake import MooncakeStore

    release, entered = threading.Event(), threading.Event()

    class FakeMooncake:
        def batch_put_from_multi_buffers(self, keys, *args):
            entered.set()
            assert release.wait(10)
            return [0] * len(keys)

        def batch_is_exist(self, keys):
            return [1] * len(keys)

    store = MooncakeStore.__new__(MooncakeStore)  # the call paths only, without a Mooncake cluster
    store.config = StoreConfig.parse(MINIMAL, FLAG)
    store.max_batch_keys, store.error_counts, store._lock, store._running = 8, {}, threading.Lock(), {}
    store._master_down, store._store = False, FakeMooncake()
    put = threading.Thread(target=store._batched, args=(["a"], lambda lo, hi: (
        [True], store._call("batch_put_from_multi_buffers", ["a"], [], []))))
    put.start()
    try:
        assert entered.wait(10)
        assert store.exists(["k1", "k2"]) == [True, True]  # while the put holds the lock
        assert store.running_call == "batch_put_from_multi_buffers, 1 keys" and store.call_running_s() > 0.0
    finally:
        release.set()
        put.join(10)
    assert store.call_running_s() == 0.0 and store.running_call == ""
